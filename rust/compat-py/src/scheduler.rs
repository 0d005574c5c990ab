//! `Scheduler` and `StepPlan`: the engine crosses the boundary once per step each way
//! (`schedule()`, `update()`), with the caller's string ids on the Python side.
//!
//! Methods hold the GIL for their few microseconds, so a `snapshot()` from another
//! thread never sees half a step.
use compat_core::error::CoreError;
use compat_core::scheduler::{
    FinishReason, NewRequest, RequestId, Scheduler as CoreScheduler, SchedulerConfig, StepResult,
};
use pyo3::prelude::*;

use crate::error::PyCoreError;

/// Continuous-batching scheduler: FIFO admission, chunked prefill, decode first,
/// LIFO preemption with recompute under KV pressure.
#[pyclass(module = "compat_serve._native")]
#[derive(Debug)]
pub struct Scheduler {
    inner: CoreScheduler,
}

/// One engine step: what to prefill, what to decode, what was evicted.
#[pyclass(frozen, get_all, module = "compat_serve._native")]
#[derive(Debug)]
pub struct StepPlan {
    /// `(id, start, len, is_last_chunk)`: compute tokens `[start, start + len)`; sample
    /// after a last chunk.
    prefill: Vec<(String, u32, u32, bool)>,
    /// Requests that feed their last sampled token.
    decode: Vec<String>,
    /// Requests whose KV must be dropped; they are prefilled again from 0 later.
    preempted: Vec<String>,
}

#[pymethods]
impl StepPlan {
    /// Tokens the step computes.
    #[getter]
    fn num_tokens(&self) -> u64 {
        self.prefill.iter().map(|w| u64::from(w.2)).sum::<u64>() + self.decode.len() as u64
    }

    fn __repr__(&self) -> String {
        format!(
            "<StepPlan prefill={} decode={} preempted={} tokens={}>",
            self.prefill.len(),
            self.decode.len(),
            self.preempted.len(),
            self.num_tokens()
        )
    }
}

impl Scheduler {
    fn id(&self, external_id: &str) -> Result<RequestId, PyCoreError> {
        self.inner
            .lookup(external_id)
            .ok_or_else(|| PyCoreError(CoreError::UnknownRequest(format!("{external_id:?}"))))
    }

    fn name(&self, id: RequestId) -> String {
        self.inner
            .external_id(id)
            .expect("planned requests are live")
            .to_owned()
    }

    fn ids(&self, entries: Vec<(String, u32)>) -> Result<Vec<(RequestId, u32)>, PyCoreError> {
        entries
            .into_iter()
            .map(|(name, value)| Ok((self.id(&name)?, value)))
            .collect()
    }
}

#[pymethods]
impl Scheduler {
    #[new]
    #[pyo3(signature = (
        max_num_seqs,
        max_num_batched_tokens,
        prefill_chunk,
        kv_capacity_tokens,
        context_length,
        decode_prefill_chunk = None,
    ))]
    fn new(
        max_num_seqs: usize,
        max_num_batched_tokens: u32,
        prefill_chunk: u32,
        kv_capacity_tokens: u64,
        context_length: u32,
        decode_prefill_chunk: Option<u32>,
    ) -> PyResult<Self> {
        let config = SchedulerConfig {
            max_num_seqs,
            max_num_batched_tokens,
            prefill_chunk,
            decode_prefill_chunk: decode_prefill_chunk.unwrap_or(prefill_chunk),
            kv_capacity_tokens,
            context_length,
        };
        let inner = CoreScheduler::new(config).map_err(PyCoreError)?;
        Ok(Self { inner })
    }

    /// Queues a request (FIFO). `id` must not belong to a live request.
    #[pyo3(signature = (id, prompt_len, max_tokens, stop_token_ids = Vec::new(), cached_tokens = 0))]
    fn add_request(
        &mut self,
        id: String,
        prompt_len: u32,
        max_tokens: u32,
        stop_token_ids: Vec<u32>,
        cached_tokens: u32,
    ) -> PyResult<()> {
        let new = NewRequest {
            external_id: id,
            prompt_len,
            max_tokens,
            stop_token_ids,
            cached_tokens,
        };
        self.inner.add_request(new).map_err(PyCoreError)?;
        Ok(())
    }

    /// Plans the next step; `update()` must follow before the next `schedule()`.
    fn schedule(&mut self) -> PyResult<StepPlan> {
        let plan = self.inner.schedule().map_err(PyCoreError)?;
        Ok(StepPlan {
            prefill: plan
                .prefill
                .iter()
                .map(|w| (self.name(w.id), w.start, w.len, w.is_last_chunk))
                .collect(),
            decode: plan.decode.iter().map(|&id| self.name(id)).collect(),
            preempted: plan.preempted.iter().map(|&id| self.name(id)).collect(),
        })
    }

    /// Reports the step: `prefilled` = `(id, tokens computed)` for every planned
    /// prefill, `sampled` = `(id, token)` for every decode and last chunk (a decoding
    /// request may report several tokens in order: accepted speculated tokens, each
    /// but the last leaving it running). Returns `(id, reason)` for each request that
    /// finished; they are forgotten.
    fn update(
        &mut self,
        prefilled: Vec<(String, u32)>,
        sampled: Vec<(String, u32)>,
    ) -> PyResult<Vec<(String, &'static str)>> {
        let result = StepResult {
            prefilled: self.ids(prefilled)?,
            sampled: self.ids(sampled)?,
        };
        let finished = self.inner.update(&result).map_err(PyCoreError)?;
        Ok(finished
            .into_iter()
            .map(|f| (f.external_id, f.reason.as_str()))
            .collect())
    }

    /// Ends a request as aborted; `False` if it already ended or never existed.
    fn abort(&mut self, id: &str) -> bool {
        self.inner
            .lookup(id)
            .is_some_and(|rid| self.inner.abort(rid))
    }

    /// Ends a request for a reason decided in Python (`"external"` for a stop string or
    /// an error; also `"stop_token"`, `"max_tokens"`, `"context_full"`, `"aborted"`);
    /// `False` if it already ended or never existed.
    fn finish(&mut self, id: &str, reason: &str) -> PyResult<bool> {
        let reason: FinishReason = reason.parse().map_err(PyCoreError)?;
        Ok(self
            .inner
            .lookup(id)
            .is_some_and(|rid| self.inner.finish(rid, reason)))
    }

    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }

    #[getter]
    fn kv_tokens_used(&self) -> u64 {
        self.inner.kv_used()
    }

    /// Tokens of KV still free: room for speculated tokens beyond the plan.
    #[getter]
    fn kv_tokens_free(&self) -> u32 {
        self.inner.kv_headroom()
    }

    /// Prompt plus output tokens at which a request ends with `context_full`.
    #[getter]
    fn token_limit(&self) -> u32 {
        self.inner.token_limit()
    }

    /// `(id, status, computed, generated)` per live request, running first.
    fn snapshot(&self) -> Vec<(String, &'static str, u32, u32)> {
        self.inner
            .snapshot()
            .into_iter()
            .map(|r| {
                (
                    r.external_id,
                    r.status.as_str(),
                    r.num_computed,
                    r.num_output,
                )
            })
            .collect()
    }

    /// Raises `SchedulerError` if an internal invariant is broken (for tests).
    fn check_invariants(&self) -> PyResult<()> {
        Ok(self.inner.check_invariants().map_err(PyCoreError)?)
    }

    fn __repr__(&self) -> String {
        format!(
            "<Scheduler running={} waiting={} kv_tokens_used={}>",
            self.inner.num_running(),
            self.inner.num_waiting(),
            self.inner.kv_used()
        )
    }
}
