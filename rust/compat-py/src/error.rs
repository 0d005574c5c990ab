//! The one place where core errors become Python exceptions.
use compat_core::error::CoreError;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;

pyo3::create_exception!(
    compat_serve._native,
    TemplateError,
    PyException,
    "A chat template failed to compile, failed to render, or called raise_exception()."
);

pyo3::create_exception!(
    compat_serve._native,
    SchedulerError,
    PyException,
    "The scheduler was misused: unknown or duplicate request id, invalid status \
     transition, or a step result that does not match its plan."
);

pyo3::create_exception!(
    compat_serve._native,
    GrammarError,
    PyValueError,
    "A grammar (JSON schema, Lark, regex) failed to compile, or generation left it."
);

/// Wrapper so `?` can turn a [`CoreError`] into a `PyErr` (orphan rule).
#[derive(Debug)]
pub struct PyCoreError(pub CoreError);

impl From<CoreError> for PyCoreError {
    fn from(err: CoreError) -> Self {
        Self(err)
    }
}

impl From<PyCoreError> for PyErr {
    fn from(err: PyCoreError) -> Self {
        match err.0 {
            CoreError::Template(msg) | CoreError::TemplateRaised(msg) => {
                TemplateError::new_err(msg)
            }
            CoreError::Grammar(msg) => GrammarError::new_err(msg),
            CoreError::InvalidInput(msg) => PyValueError::new_err(msg),
            err @ (CoreError::InvalidTransition { .. }
            | CoreError::UnknownRequest(_)
            | CoreError::DuplicateRequest(_)
            | CoreError::InvalidStep(_)
            | CoreError::BrokenInvariant(_)) => SchedulerError::new_err(err.to_string()),
        }
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("TemplateError", m.py().get_type::<TemplateError>())?;
    m.add("SchedulerError", m.py().get_type::<SchedulerError>())?;
    m.add("GrammarError", m.py().get_type::<GrammarError>())
}
