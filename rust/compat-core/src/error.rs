//! The core's one error type.

/// Every failure the core can report.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// A chat template failed to compile or to render.
    #[error("{0}")]
    Template(String),
    /// The template itself called `raise_exception(message)`; the message is verbatim.
    #[error("{0}")]
    TemplateRaised(String),
    /// Input given to the core was malformed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
}
