//! `TokenTable` and `GrammarMatcher`: constrained decoding for Python. Compiling and
//! mask computation release the GIL; masks cross as bytes of little-endian `u32` words.
use std::sync::{Arc, Mutex, MutexGuard};

use compat_core::error::CoreError;
use compat_core::grammar::{self, Constraint, GrammarSpec, TokenTable as CoreTable};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

use crate::error::PyCoreError;

/// One model's vocabulary as the grammar engine sees it.
#[pyclass(frozen, module = "compat_serve._native")]
#[derive(Debug)]
pub struct TokenTable {
    inner: Arc<CoreTable>,
}

#[pymethods]
#[allow(clippy::needless_pass_by_value)] // pyo3 extracts arguments as owned values
impl TokenTable {
    /// From a `tokenizer.json` text (`tokenizers.Tokenizer.to_str()`).
    #[new]
    fn new(
        py: Python<'_>,
        tokenizer_json: &str,
        eos_token_ids: Vec<u32>,
        logits_width: usize,
    ) -> PyResult<Self> {
        let table = py
            .detach(|| CoreTable::from_tokenizer_json(tokenizer_json, &eos_token_ids, logits_width))
            .map_err(PyCoreError)?;
        Ok(Self {
            inner: Arc::new(table),
        })
    }

    /// From each token's bytes (special tokens: `b"\xff"` + name).
    #[staticmethod]
    fn from_token_bytes(
        py: Python<'_>,
        tokens: Vec<Vec<u8>>,
        eos_token_ids: Vec<u32>,
        logits_width: usize,
    ) -> PyResult<Self> {
        let table = py
            .detach(|| CoreTable::from_token_bytes(&tokens, &eos_token_ids, logits_width))
            .map_err(PyCoreError)?;
        Ok(Self {
            inner: Arc::new(table),
        })
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }

    /// `u32` words per mask row.
    #[getter]
    fn mask_words(&self) -> usize {
        self.inner.mask_words()
    }

    fn special_token(&self, name: &str) -> Option<u32> {
        self.inner.special_token(name)
    }

    fn token_bytes<'py>(&self, py: Python<'py>, token: u32) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.inner.token_bytes(token))
    }

    /// Compiles a grammar: `kind` is `json_schema`, `lark` or `regex`.
    fn compile(&self, py: Python<'_>, kind: &str, source: String) -> PyResult<GrammarMatcher> {
        let spec = GrammarSpec::new(kind, source).map_err(PyCoreError)?;
        let table = Arc::clone(&self.inner);
        let constraint = py
            .detach(move || table.compile(&spec))
            .map_err(PyCoreError)?;
        Ok(GrammarMatcher {
            inner: Arc::new(Mutex::new(constraint)),
        })
    }
}

/// One request's grammar state.
#[pyclass(frozen, module = "compat_serve._native")]
#[derive(Debug)]
pub struct GrammarMatcher {
    inner: Arc<Mutex<Constraint>>,
}

impl GrammarMatcher {
    fn lock(&self) -> MutexGuard<'_, Constraint> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

#[pymethods]
#[allow(clippy::needless_pass_by_value)] // pyo3 extracts arguments as owned values
impl GrammarMatcher {
    /// The allowed next tokens: `mask_words` little-endian `u32` words.
    fn mask<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let inner = Arc::clone(&self.inner);
        let words = py.detach(move || {
            let mut constraint = inner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let mut out = vec![0u32; constraint.mask_words()];
            constraint.fill_mask(&mut out).map(|()| out)
        });
        Ok(PyBytes::new(py, &to_le_bytes(&words.map_err(PyCoreError)?)))
    }

    /// Advances past `token`; `GrammarError` if the grammar does not allow it.
    fn consume(&self, token: u32) -> PyResult<()> {
        Ok(self.lock().consume(token).map_err(PyCoreError)?)
    }

    /// How many of `tokens` would be accepted in order (nothing is consumed).
    fn validate(&self, tokens: Vec<u32>) -> PyResult<usize> {
        Ok(self.lock().validate(&tokens).map_err(PyCoreError)?)
    }

    fn rollback(&self, n: usize) -> PyResult<()> {
        Ok(self.lock().rollback(n).map_err(PyCoreError)?)
    }

    /// Complete, and nothing may follow: generation should end.
    fn is_stopped(&self) -> bool {
        self.lock().is_stopped()
    }

    /// The output so far is a complete match.
    fn is_accepting(&self) -> bool {
        self.lock().is_accepting()
    }

    #[getter]
    fn consumed(&self) -> usize {
        self.lock().consumed()
    }

    #[getter]
    fn mask_words(&self) -> usize {
        self.lock().mask_words()
    }
}

/// Masks for a batch: one row per entry (`None`: every token allowed), as
/// `rows * words` little-endian `u32` words, plus each row's error (or `None`).
#[pyfunction]
#[allow(clippy::needless_pass_by_value)] // pyo3 extracts arguments as owned values
pub fn fill_masks<'py>(
    py: Python<'py>,
    matchers: Vec<Option<PyRef<'py, GrammarMatcher>>>,
    words: usize,
) -> (Bound<'py, PyBytes>, Vec<Option<String>>) {
    let shared: Vec<Option<Arc<Mutex<Constraint>>>> = matchers
        .iter()
        .map(|m| m.as_ref().map(|m| Arc::clone(&m.inner)))
        .collect();
    let (out, errors) = py.detach(move || {
        let mut guards: Vec<Option<MutexGuard<'_, Constraint>>> = shared
            .iter()
            .map(|m| {
                m.as_ref()
                    .map(|m| m.lock().unwrap_or_else(std::sync::PoisonError::into_inner))
            })
            .collect();
        let mut rows: Vec<Option<&mut Constraint>> =
            guards.iter_mut().map(|g| g.as_deref_mut()).collect();
        let mut out = vec![0u32; rows.len() * words];
        let errors = grammar::fill_masks(&mut rows, &mut out, words);
        let errors: Vec<Option<String>> = errors
            .into_iter()
            .map(|e| e.map(|e: CoreError| e.to_string()))
            .collect();
        (out, errors)
    });
    (PyBytes::new(py, &to_le_bytes(&out)), errors)
}

fn to_le_bytes(words: &[u32]) -> Vec<u8> {
    words.iter().flat_map(|w| w.to_le_bytes()).collect()
}
