//! The core's one error type.
use crate::scheduler::RequestStatus;

/// Every failure the core can report.
#[derive(Debug, thiserror::Error)]
pub enum CoreError {
    /// A chat template failed to compile or to render.
    #[error("{0}")]
    Template(String),
    /// The template itself called `raise_exception(message)`; the message is verbatim.
    #[error("{0}")]
    TemplateRaised(String),
    /// A grammar (JSON schema, Lark, regex) failed to compile, or generation left it.
    #[error("{0}")]
    Grammar(String),
    /// Input given to the core was malformed.
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A request status change the state machine does not allow.
    #[error("request {id:?}: invalid transition {from} -> {to}")]
    InvalidTransition {
        id: String,
        from: RequestStatus,
        to: RequestStatus,
    },
    /// No live request has this id.
    #[error("unknown request {0}")]
    UnknownRequest(String),
    /// A live request already has this id.
    #[error("duplicate request id {0:?}")]
    DuplicateRequest(String),
    /// `schedule()` / `update()` used out of order, or a step result that does not
    /// match the plan.
    #[error("invalid scheduler step: {0}")]
    InvalidStep(String),
    /// A scheduler invariant does not hold (a bug; reported by `check_invariants`).
    #[error("scheduler invariant broken: {0}")]
    BrokenInvariant(String),
}
