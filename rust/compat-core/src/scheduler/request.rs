//! One request as the scheduler sees it: ids, status, token counts, and the one
//! checked status transition.
use std::fmt;
use std::str::FromStr;

use crate::error::CoreError;

/// A request's id inside the scheduler: an arena slot plus the slot's generation, so
/// an id kept after its request ended can never name the slot's next occupant.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId {
    slot: u32,
    generation: u32,
}

impl RequestId {
    pub(super) const fn new(slot: u32, generation: u32) -> Self {
        Self { slot, generation }
    }

    pub(super) const fn slot(self) -> usize {
        self.slot as usize
    }

    pub(super) const fn generation(self) -> u32 {
        self.generation
    }
}

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}.{}", self.slot, self.generation)
    }
}

/// Why a request ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FinishReason {
    /// The model sampled one of the request's stop tokens (included in the output).
    StopToken,
    /// The request generated `max_tokens` tokens.
    MaxTokens,
    /// The sequence filled the context window (or the whole KV capacity).
    ContextFull,
    /// The client went away or the engine shut down.
    Aborted,
    /// Decided outside the scheduler (a stop string matched, or the engine failed).
    External,
}

impl FinishReason {
    pub const ALL: [Self; 5] = [
        Self::StopToken,
        Self::MaxTokens,
        Self::ContextFull,
        Self::Aborted,
        Self::External,
    ];

    /// The lowercase name used across the Python boundary.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::StopToken => "stop_token",
            Self::MaxTokens => "max_tokens",
            Self::ContextFull => "context_full",
            Self::Aborted => "aborted",
            Self::External => "external",
        }
    }
}

impl fmt::Display for FinishReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for FinishReason {
    type Err = CoreError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::ALL
            .into_iter()
            .find(|r| r.as_str() == s)
            .ok_or_else(|| CoreError::InvalidInput(format!("unknown finish reason {s:?}")))
    }
}

/// Where a request is in its life. Only [`Request::transition`] changes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RequestStatus {
    /// Queued, never run (or nothing computed yet).
    Waiting,
    /// Admitted: holds KV, prefills in chunks, then decodes one token per step.
    Running,
    /// Evicted under KV pressure; its KV is gone and will be recomputed on re-admission.
    Preempted,
    /// Ended; terminal.
    Finished(FinishReason),
}

impl RequestStatus {
    pub const fn is_finished(self) -> bool {
        matches!(self, Self::Finished(_))
    }

    /// The transition table (the only one).
    const fn allows(self, to: Self) -> bool {
        matches!(
            (self, to),
            (Self::Waiting | Self::Preempted, Self::Running)
                | (Self::Running, Self::Preempted)
                | (
                    Self::Waiting | Self::Running | Self::Preempted,
                    Self::Finished(_)
                )
        )
    }

    /// The lowercase name used across the Python boundary.
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Running => "running",
            Self::Preempted => "preempted",
            Self::Finished(_) => "finished",
        }
    }
}

impl fmt::Display for RequestStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Finished(reason) => write!(f, "finished({reason})"),
            other => f.write_str(other.as_str()),
        }
    }
}

/// A request's scheduling state. The scheduler never sees token ids of the prompt;
/// it counts tokens, and checks sampled ids against the stop tokens.
#[derive(Debug)]
pub struct Request {
    pub(super) external_id: String,
    pub(super) prompt_len: u32,
    pub(super) max_tokens: u32,
    pub(super) stop_token_ids: Box<[u32]>,
    /// Prompt tokens served from the prefix cache at (first) admission.
    pub(super) num_cached: u32,
    status: RequestStatus,
    /// Tokens sampled so far.
    pub(super) num_output: u32,
    /// Tokens whose KV is in the cache (committed by `update`).
    pub(super) num_computed: u32,
    /// Tokens planned by the outstanding `schedule()`, KV reserved, not yet committed.
    pub(super) num_scheduled: u32,
    /// What the engine reported for this request in the `update` being validated.
    pub(super) report: Report,
}

/// One request's part of a `StepResult`, gathered before anything is applied.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Report {
    pub prefilled: Option<u32>,
    /// The last token sampled (the only one, unless the request speculated).
    pub sampled: Option<u32>,
    /// Tokens a decoding request reported before `sampled` (accepted draft tokens).
    pub extra: u32,
    /// One of the `extra` tokens would have ended the request.
    pub ended_early: bool,
}

impl Request {
    pub(super) fn new(
        external_id: String,
        prompt_len: u32,
        max_tokens: u32,
        stop_token_ids: Box<[u32]>,
        num_cached: u32,
    ) -> Self {
        Self {
            external_id,
            prompt_len,
            max_tokens,
            stop_token_ids,
            num_cached,
            status: RequestStatus::Waiting,
            num_output: 0,
            num_computed: 0,
            num_scheduled: 0,
            report: Report::default(),
        }
    }

    /// The one checked place where a status changes.
    pub fn transition(&mut self, to: RequestStatus) -> Result<(), CoreError> {
        if !self.status.allows(to) {
            return Err(CoreError::InvalidTransition {
                id: self.external_id.clone(),
                from: self.status,
                to,
            });
        }
        self.status = to;
        Ok(())
    }

    pub fn status(&self) -> RequestStatus {
        self.status
    }

    pub fn external_id(&self) -> &str {
        &self.external_id
    }

    pub fn prompt_len(&self) -> u32 {
        self.prompt_len
    }

    pub fn max_tokens(&self) -> u32 {
        self.max_tokens
    }

    /// Tokens sampled so far.
    pub fn num_output(&self) -> u32 {
        self.num_output
    }

    /// Tokens whose KV is committed.
    /// Prompt tokens served from the prefix cache at admission (0 after a preemption).
    pub fn num_cached(&self) -> u32 {
        self.num_cached
    }

    pub fn num_computed(&self) -> u32 {
        self.num_computed
    }

    /// Prompt plus sampled tokens: what a (re)computation has to cover.
    pub fn num_tokens(&self) -> u32 {
        self.prompt_len + self.num_output
    }

    /// KV held, including the outstanding step's reservation.
    pub(super) fn kv_held(&self) -> u32 {
        self.num_computed + self.num_scheduled
    }

    /// Decoding: everything but the last sampled token is computed, so the next step
    /// feeds that one token. (A recompute that lands here also continues as decode:
    /// the remaining token is the last sampled one either way.)
    pub(super) fn is_decoding(&self) -> bool {
        self.num_output > 0 && self.num_computed + 1 == self.num_tokens()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL_STATUSES: [RequestStatus; 8] = [
        RequestStatus::Waiting,
        RequestStatus::Running,
        RequestStatus::Preempted,
        RequestStatus::Finished(FinishReason::StopToken),
        RequestStatus::Finished(FinishReason::MaxTokens),
        RequestStatus::Finished(FinishReason::ContextFull),
        RequestStatus::Finished(FinishReason::Aborted),
        RequestStatus::Finished(FinishReason::External),
    ];

    fn request_in(status: RequestStatus) -> Request {
        let mut r = Request::new("r".into(), 4, 4, Box::new([]), 0);
        r.status = status;
        r
    }

    /// The documented transitions, restated independently of `allows`.
    fn expected(from: RequestStatus, to: RequestStatus) -> bool {
        use RequestStatus::{Preempted, Running, Waiting};
        let edges = [
            (Waiting, Running),
            (Running, Preempted),
            (Preempted, Running),
        ];
        edges.contains(&(from, to))
            || ([Waiting, Running, Preempted].contains(&from) && to.is_finished())
    }

    #[test]
    fn waiting_to_running() {
        let mut r = request_in(RequestStatus::Waiting);
        r.transition(RequestStatus::Running).unwrap();
        assert_eq!(r.status(), RequestStatus::Running);
    }

    #[test]
    fn running_to_preempted_and_back() {
        let mut r = request_in(RequestStatus::Running);
        r.transition(RequestStatus::Preempted).unwrap();
        assert_eq!(r.status(), RequestStatus::Preempted);
        r.transition(RequestStatus::Running).unwrap();
        assert_eq!(r.status(), RequestStatus::Running);
    }

    #[test]
    fn every_live_state_can_finish_with_every_reason() {
        for from in [
            RequestStatus::Waiting,
            RequestStatus::Running,
            RequestStatus::Preempted,
        ] {
            for reason in FinishReason::ALL {
                let mut r = request_in(from);
                r.transition(RequestStatus::Finished(reason)).unwrap();
                assert_eq!(r.status(), RequestStatus::Finished(reason));
            }
        }
    }

    #[test]
    fn nothing_leaves_finished() {
        for reason in FinishReason::ALL {
            for to in ALL_STATUSES {
                let mut r = request_in(RequestStatus::Finished(reason));
                let err = r.transition(to).unwrap_err();
                assert!(matches!(err, CoreError::InvalidTransition { .. }), "{err}");
                assert_eq!(r.status(), RequestStatus::Finished(reason));
            }
        }
    }

    #[test]
    fn invalid_transitions_are_rejected_and_leave_the_status() {
        use RequestStatus::{Preempted, Running, Waiting};
        for (from, to) in [
            (Waiting, Waiting),
            (Waiting, Preempted),
            (Running, Running),
            (Running, Waiting),
            (Preempted, Preempted),
            (Preempted, Waiting),
        ] {
            let mut r = request_in(from);
            let err = r.transition(to).unwrap_err();
            assert_eq!(
                err.to_string(),
                format!("request \"r\": invalid transition {from} -> {to}")
            );
            assert_eq!(r.status(), from);
        }
    }

    #[test]
    fn table_matches_the_documented_transitions_exhaustively() {
        for from in ALL_STATUSES {
            for to in ALL_STATUSES {
                let mut r = request_in(from);
                assert_eq!(
                    r.transition(to).is_ok(),
                    expected(from, to),
                    "{from} -> {to}"
                );
            }
        }
    }

    #[test]
    fn finish_reason_names_round_trip() {
        for reason in FinishReason::ALL {
            assert_eq!(reason.as_str().parse::<FinishReason>().unwrap(), reason);
        }
        assert!("stop".parse::<FinishReason>().is_err());
    }

    #[test]
    fn decoding_means_only_the_last_sampled_token_is_left() {
        let mut r = request_in(RequestStatus::Running);
        assert!(!r.is_decoding());
        r.num_computed = 3;
        assert!(!r.is_decoding(), "one prompt token left is a prefill");
        r.num_computed = 4;
        r.num_output = 1;
        assert!(r.is_decoding());
    }
}
