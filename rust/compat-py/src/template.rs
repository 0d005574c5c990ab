//! `ChatTemplate`: a compiled chat template; `render` releases the GIL.
use chrono::NaiveDateTime;
use compat_core::template::ChatTemplate as CoreTemplate;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use serde_json::{Map, Value};

use crate::convert::to_json;
use crate::error::PyCoreError;

/// A compiled Hugging Face chat template, rendered like transformers does.
#[pyclass(frozen, module = "compat_serve._native")]
#[derive(Debug)]
pub struct ChatTemplate {
    inner: CoreTemplate,
    source: String,
}

#[pymethods]
impl ChatTemplate {
    #[new]
    #[pyo3(signature = (source, *, now = None))]
    fn new(source: String, now: Option<NaiveDateTime>) -> PyResult<Self> {
        let inner = CoreTemplate::with_clock(&source, now).map_err(PyCoreError)?;
        Ok(Self { inner, source })
    }

    /// The template source as given.
    #[getter]
    fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (plus `tools`, `documents` and any extra variables).
    #[pyo3(signature = (
        messages,
        tools = None,
        add_generation_prompt = false,
        bos_token = None,
        eos_token = None,
        **kwargs
    ))]
    #[allow(clippy::too_many_arguments)] // mirrors the Python signature
    fn render(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyAny>,
        tools: Option<&Bound<'_, PyAny>>,
        add_generation_prompt: bool,
        bos_token: Option<&str>,
        eos_token: Option<&str>,
        kwargs: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<String> {
        // transformers always passes `tools` and `documents` (None when absent),
        // and special tokens only when the tokenizer defines them.
        let mut ctx = Map::new();
        ctx.insert("messages".into(), to_json(messages)?);
        let tools = match tools {
            Some(t) => to_json(t)?,
            None => Value::Null,
        };
        ctx.insert("tools".into(), tools);
        ctx.insert("documents".into(), Value::Null);
        ctx.insert(
            "add_generation_prompt".into(),
            Value::Bool(add_generation_prompt),
        );
        if let Some(bos) = bos_token {
            ctx.insert("bos_token".into(), Value::from(bos));
        }
        if let Some(eos) = eos_token {
            ctx.insert("eos_token".into(), Value::from(eos));
        }
        if let Some(kwargs) = kwargs {
            for (k, v) in kwargs.iter() {
                ctx.insert(k.extract::<String>()?, to_json(&v)?);
            }
        }
        let ctx = Value::Object(ctx);
        let inner = &self.inner;
        let rendered = py.detach(move || inner.render(&ctx));
        Ok(rendered.map_err(PyCoreError)?)
    }

    fn __repr__(&self) -> String {
        format!("<ChatTemplate ({} bytes)>", self.source.len())
    }
}
