//! What crosses the scheduler's boundary: configuration, new requests, the plan for
//! one step, the engine's result for it, and what finished.
use crate::error::CoreError;

use super::request::{FinishReason, RequestId, RequestStatus};

/// Limits the scheduler plans under.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests running at once (`--max-num-seqs`).
    pub max_num_seqs: usize,
    /// Most tokens computed in one step, prefill and decode together
    /// (`--max-num-batched-tokens`).
    pub max_num_batched_tokens: u32,
    /// Most prompt tokens one request prefills in one step (`--prefill-chunk`).
    pub prefill_chunk: u32,
    /// The same limit in a step that also decodes (`--decode-prefill-chunk`): smaller,
    /// so running streams wait less for their next token while a prompt is admitted.
    /// Values above `prefill_chunk` mean `prefill_chunk`.
    pub decode_prefill_chunk: u32,
    /// KV memory, in tokens, shared by all running requests.
    pub kv_capacity_tokens: u64,
    /// The model's context window: prompt plus generated tokens.
    pub context_length: u32,
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), CoreError> {
        let bad = |msg: &str| Err(CoreError::InvalidInput(format!("scheduler config: {msg}")));
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be at least 1");
        }
        if self.prefill_chunk == 0 {
            return bad("prefill_chunk must be at least 1");
        }
        if self.decode_prefill_chunk == 0 {
            return bad("decode_prefill_chunk must be at least 1");
        }
        if self.kv_capacity_tokens == 0 {
            return bad("kv_capacity_tokens must be at least 1");
        }
        if self.context_length < 2 {
            return bad("context_length must be at least 2");
        }
        // Every running request may decode in the same step; vLLM enforces the same.
        if (self.max_num_batched_tokens as usize) < self.max_num_seqs {
            return bad("max_num_batched_tokens must be at least max_num_seqs");
        }
        Ok(())
    }

    /// A sequence stops at this many tokens: the context window, or what the whole KV
    /// capacity can hold (the last sampled token never needs KV), whichever is smaller.
    pub fn token_limit(&self) -> u32 {
        let by_kv = u32::try_from(self.kv_capacity_tokens.saturating_add(1)).unwrap_or(u32::MAX);
        self.context_length.min(by_kv)
    }
}

/// A request to admit. Named fields leave room for more (priority, cache salt).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewRequest {
    /// The caller's id; unique among live requests.
    pub external_id: String,
    pub prompt_len: u32,
    pub max_tokens: u32,
    pub stop_token_ids: Vec<u32>,
    /// Leading prompt tokens whose KV the engine already has (a prefix-cache hit):
    /// prefill starts after them. Must be below `prompt_len`. A preempted request
    /// recomputes from 0 (its assembled cache is gone).
    pub cached_tokens: u32,
}

/// Prompt (or recompute) tokens `[start, start + len)` of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PrefillWork {
    pub id: RequestId,
    pub start: u32,
    pub len: u32,
    /// This chunk reaches the last known token: the engine samples from its logits.
    pub is_last_chunk: bool,
}

/// One engine step. Fields, not positions, so priorities or cache hits can be added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Chunked prefills: running requests continuing first, then new admissions.
    pub prefill: Vec<PrefillWork>,
    /// Requests feeding their last sampled token, one token each.
    pub decode: Vec<RequestId>,
    /// Requests evicted this step: drop their KV; they recompute when re-admitted.
    pub preempted: Vec<RequestId>,
}

impl StepPlan {
    /// Tokens the step computes (what the budget bounds).
    pub fn num_tokens(&self) -> u64 {
        self.prefill.iter().map(|w| u64::from(w.len)).sum::<u64>() + self.decode.len() as u64
    }

    /// Nothing to compute (preemptions alone do not make a step).
    pub fn is_idle(&self) -> bool {
        self.prefill.is_empty() && self.decode.is_empty()
    }
}

/// What the engine did with a [`StepPlan`].
///
/// Every planned prefill is reported in `prefilled` with the tokens actually computed
/// (at most planned; fewer are allowed and the rest is planned again); every decode and
/// every prefill that reached the last token reports one token in `sampled`.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepResult {
    pub prefilled: Vec<(RequestId, u32)>,
    pub sampled: Vec<(RequestId, u32)>,
}

/// A request that ended; reported exactly once, after which the scheduler forgets it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Finished {
    pub id: RequestId,
    pub external_id: String,
    pub reason: FinishReason,
    pub num_output: u32,
}

/// One live request, for `/v1/status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestSnapshot {
    pub external_id: String,
    pub status: RequestStatus,
    pub num_computed: u32,
    pub num_output: u32,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config() -> SchedulerConfig {
        SchedulerConfig {
            max_num_seqs: 4,
            max_num_batched_tokens: 16,
            prefill_chunk: 8,
            decode_prefill_chunk: 4,
            kv_capacity_tokens: 64,
            context_length: 128,
        }
    }

    #[test]
    fn config_validation() {
        assert!(config().validate().is_ok());
        for broken in [
            SchedulerConfig {
                max_num_seqs: 0,
                ..config()
            },
            SchedulerConfig {
                prefill_chunk: 0,
                ..config()
            },
            SchedulerConfig {
                decode_prefill_chunk: 0,
                ..config()
            },
            SchedulerConfig {
                kv_capacity_tokens: 0,
                ..config()
            },
            SchedulerConfig {
                context_length: 1,
                ..config()
            },
            SchedulerConfig {
                max_num_batched_tokens: 3,
                ..config()
            },
        ] {
            let err = broken.validate().unwrap_err();
            assert!(matches!(err, CoreError::InvalidInput(_)), "{err}");
        }
    }

    #[test]
    fn token_limit_is_the_smaller_of_context_and_kv() {
        assert_eq!(config().token_limit(), 65);
        let roomy = SchedulerConfig {
            kv_capacity_tokens: u64::MAX,
            ..config()
        };
        assert_eq!(roomy.token_limit(), 128);
    }

    #[test]
    fn plan_counts_prefill_and_decode_tokens() {
        let id = RequestId::new(0, 0);
        let plan = StepPlan {
            prefill: vec![PrefillWork {
                id,
                start: 0,
                len: 5,
                is_last_chunk: false,
            }],
            decode: vec![RequestId::new(1, 0), RequestId::new(2, 0)],
            preempted: vec![RequestId::new(3, 0)],
        };
        assert_eq!(plan.num_tokens(), 7);
        assert!(!plan.is_idle());
        assert!(StepPlan::default().is_idle());
    }
}
