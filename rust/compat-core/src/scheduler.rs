//! The scheduler: owns every request, plans each engine step under a token budget, a
//! batch size and KV memory, and applies what the engine reports back.
//!
//! One `schedule()` plans, in this order:
//! 1. **Decode first.** Every running request that is decoding gets its one token,
//!    oldest admission first, so running streams never stall behind a long prompt.
//! 2. **Prefill continues.** Running requests mid-prefill (or mid-recompute) get up to
//!    `prefill_chunk` tokens each, oldest first, while the token budget lasts — or
//!    `decode_prefill_chunk` in a step that also decodes, so running streams get a token
//!    at least every `decode_prefill_chunk` prompt tokens of someone else's prefill.
//! 3. **Admission.** Waiting requests strictly FIFO (the head blocks the rest, so
//!    nothing starves) while `max_num_seqs` and the budget allow and the free KV holds
//!    the request's whole prompt (or recompute). Nothing is admitted in a step that
//!    preempted: an evicted request would otherwise be re-admitted at once and
//!    recompute for nothing.
//!
//! When a running request's next tokens do not fit in KV, the most recently admitted
//! running request not yet planned this step is preempted (LIFO, like vLLM) — possibly
//! the request itself. Its KV is released and it goes back to the front of the waiting
//! queue; re-admitted, it recomputes prompt plus generated tokens. A prefill that
//! cannot evict anyone newer takes the KV that is left.
//!
//! `schedule()` reserves KV for the plan; `update()` commits what the engine reports,
//! appends sampled tokens and applies the stop-token, max-token and context checks.
//! A decoding request may report several tokens (speculative decoding: drafts verified
//! in the same forward); all but the last must leave it running, and their KV beyond
//! the one token reserved must fit the headroom.
//! They alternate: one plan is outstanding at a time. A request that ends is reported
//! exactly once (by `update`'s return, or `abort`/`finish` returning `true`) and then
//! forgotten.
use std::collections::VecDeque;

use crate::error::CoreError;

mod arena;
mod invariants;
mod kv;
mod plan;
#[cfg(test)]
mod proptests;
mod request;
#[cfg(test)]
mod tests;
mod update;

use arena::Requests;
pub use kv::{KvBudget, TokenKv};
pub use plan::{
    Finished, NewRequest, PrefillWork, RequestSnapshot, SchedulerConfig, StepPlan, StepResult,
};
pub use request::{FinishReason, Request, RequestId, RequestStatus};

#[derive(Debug)]
pub struct Scheduler<K: KvBudget = TokenKv> {
    config: SchedulerConfig,
    token_limit: u32,
    requests: Requests,
    /// Waiting and preempted requests, admission order (preempted ones at the front).
    waiting: VecDeque<RequestId>,
    /// Running requests, oldest admission first (preemption takes from the back).
    running: Vec<RequestId>,
    kv: K,
    /// Requests planned by the outstanding `schedule()`; empty between steps.
    inflight: Vec<RequestId>,
    /// Planned requests that ended before `update()`; results for them are ignored.
    ended_inflight: Vec<(String, RequestId)>,
}

impl Scheduler<TokenKv> {
    pub fn new(config: SchedulerConfig) -> Result<Self, CoreError> {
        Self::with_kv(config, TokenKv::new(config.kv_capacity_tokens))
    }
}

impl<K: KvBudget> Scheduler<K> {
    pub fn with_kv(config: SchedulerConfig, kv: K) -> Result<Self, CoreError> {
        config.validate()?;
        Ok(Self {
            config,
            token_limit: config.token_limit(),
            requests: Requests::default(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            kv,
            inflight: Vec::new(),
            ended_inflight: Vec::new(),
        })
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Queues a request at the back of the waiting queue.
    pub fn add_request(&mut self, new: NewRequest) -> Result<RequestId, CoreError> {
        if self.requests.contains_external(&new.external_id) {
            return Err(CoreError::DuplicateRequest(new.external_id));
        }
        if new.prompt_len == 0 {
            return Err(CoreError::InvalidInput(format!(
                "request {:?}: the prompt is empty",
                new.external_id
            )));
        }
        if new.cached_tokens >= new.prompt_len {
            return Err(CoreError::InvalidInput(format!(
                "request {:?}: {} cached tokens of a {}-token prompt (at least one token \
                 must be computed)",
                new.external_id, new.cached_tokens, new.prompt_len
            )));
        }
        // At least one token must fit after the prompt.
        if new.prompt_len >= self.token_limit {
            return Err(CoreError::InvalidInput(format!(
                "request {:?}: a prompt of {} tokens leaves no room (at most {} tokens \
                 per sequence: context {}, KV capacity {})",
                new.external_id,
                new.prompt_len,
                self.token_limit - 1,
                self.config.context_length,
                self.config.kv_capacity_tokens
            )));
        }
        let request = Request::new(
            new.external_id,
            new.prompt_len,
            new.max_tokens,
            new.stop_token_ids.into_boxed_slice(),
            new.cached_tokens,
        );
        let id = self.requests.insert(request);
        self.waiting.push_back(id);
        Ok(id)
    }

    /// The id of a live request, or of one that ended since the outstanding plan (so
    /// its results can still be passed to `update`, which ignores them).
    pub fn lookup(&self, external_id: &str) -> Option<RequestId> {
        self.requests.lookup(external_id).or_else(|| {
            self.ended_inflight
                .iter()
                .find(|(ext, _)| ext == external_id)
                .map(|&(_, id)| id)
        })
    }

    pub fn request(&self, id: RequestId) -> Option<&Request> {
        self.requests.get(id)
    }

    pub fn external_id(&self, id: RequestId) -> Option<&str> {
        self.requests.get(id).map(Request::external_id)
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// KV in use, in the budget's units (tokens for [`TokenKv`]).
    pub fn kv_used(&self) -> u64 {
        self.kv.used()
    }

    /// Tokens of KV that can still be taken (speculated tokens beyond the plan's
    /// reservation must fit here).
    pub fn kv_headroom(&self) -> u32 {
        self.kv.headroom(0)
    }

    /// Prompt plus output tokens at which a request ends (`ContextFull`).
    pub fn token_limit(&self) -> u32 {
        self.token_limit
    }

    /// Live requests, running ones first, each queue in order.
    pub fn snapshot(&self) -> Vec<RequestSnapshot> {
        self.running
            .iter()
            .chain(&self.waiting)
            .map(|&id| {
                let r = self.req(id);
                RequestSnapshot {
                    external_id: r.external_id.clone(),
                    status: r.status(),
                    num_computed: r.num_computed,
                    num_output: r.num_output,
                }
            })
            .collect()
    }

    /// Plans the next step (see the module docs for the policy).
    pub fn schedule(&mut self) -> Result<StepPlan, CoreError> {
        if self
            .inflight
            .iter()
            .any(|&id| self.requests.get(id).is_some())
        {
            return Err(CoreError::InvalidStep(
                "schedule() called again before update() of the previous plan".into(),
            ));
        }
        self.inflight.clear();
        self.ended_inflight.clear();
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;
        self.plan_decodes(&mut plan, &mut budget);
        let chunk = if plan.decode.is_empty() {
            self.config.prefill_chunk
        } else {
            self.config
                .prefill_chunk
                .min(self.config.decode_prefill_chunk)
        };
        self.plan_prefills(&mut plan, &mut budget, chunk);
        if plan.preempted.is_empty() {
            self.admit(&mut plan, &mut budget, chunk);
        }
        debug_assert!(plan.num_tokens() <= u64::from(self.config.max_num_batched_tokens));
        debug_assert!(self.running.len() <= self.config.max_num_seqs);
        self.debug_check();
        Ok(plan)
    }

    fn plan_decodes(&mut self, plan: &mut StepPlan, budget: &mut u32) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            if !self.req(id).is_decoding() {
                i += 1;
                continue;
            }
            if self.make_room(i, 1, true, plan).is_none() {
                continue; // preempted itself; index i now holds the next request
            }
            self.reserve(id, 1);
            plan.decode.push(id);
            *budget -= 1;
            i += 1;
        }
    }

    fn plan_prefills(&mut self, plan: &mut StepPlan, budget: &mut u32, chunk: u32) {
        let mut i = 0;
        while i < self.running.len() && *budget > 0 {
            let id = self.running[i];
            i += 1;
            let r = self.req(id);
            if r.num_scheduled > 0 || r.is_decoding() {
                continue;
            }
            let (start, total) = (r.num_computed, r.num_tokens());
            debug_assert!(start < total, "running request {id} has nothing to compute");
            let want = (total - start).min(chunk).min(*budget);
            let len = self
                .make_room(i - 1, want, false, plan)
                .expect("a prefill never evicts itself");
            if len > 0 {
                self.reserve(id, len);
                let is_last_chunk = start + len == total;
                plan.prefill.push(PrefillWork {
                    id,
                    start,
                    len,
                    is_last_chunk,
                });
                *budget -= len;
            }
        }
    }

    fn admit(&mut self, plan: &mut StepPlan, budget: &mut u32, chunk: u32) {
        while self.running.len() < self.config.max_num_seqs && *budget > 0 {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let total = self.req(id).num_tokens();
            // KV is reserved chunk by chunk, but admission waits until the whole prompt
            // (or recompute) fits: a request admitted short of it would likely be the
            // next one evicted, its chunks computed for nothing.
            if self.kv.headroom(0) < total {
                break;
            }
            self.waiting.pop_front();
            let r = self.req_mut(id);
            r.transition(RequestStatus::Running)
                .expect("waiting and preempted requests can run");
            // Cached tokens are already computed: they hold KV but cost no budget.
            let start = r.num_cached;
            r.num_computed = start;
            self.kv.grow(0, start);
            let len = (total - start).min(chunk).min(*budget);
            self.running.push(id);
            self.reserve(id, len);
            plan.prefill.push(PrefillWork {
                id,
                start,
                len,
                is_last_chunk: start + len == total,
            });
            *budget -= len;
        }
    }

    /// Preempts the most recently admitted running requests not yet planned this step
    /// until `running[i]` can take `want` more tokens; returns how many it can take.
    /// When the next victim is the request itself, it is preempted (`None`) if
    /// `evict_self`, else it gets what is left.
    fn make_room(
        &mut self,
        i: usize,
        want: u32,
        evict_self: bool,
        plan: &mut StepPlan,
    ) -> Option<u32> {
        loop {
            let room = self.kv.headroom(self.req(self.running[i]).kv_held());
            if room >= want {
                return Some(want);
            }
            let victim = self
                .running
                .iter()
                .rposition(|&id| self.req(id).num_scheduled == 0)
                .expect("running[i] itself is unplanned");
            debug_assert!(
                victim >= i,
                "victims are newer than the request making room"
            );
            if victim == i && !evict_self {
                return Some(room);
            }
            self.preempt(victim, plan);
            if victim == i {
                return None;
            }
        }
    }

    fn preempt(&mut self, index: usize, plan: &mut StepPlan) {
        let id = self.running.remove(index);
        let r = self
            .requests
            .get_mut(id)
            .expect("running requests are live");
        debug_assert_eq!(r.num_scheduled, 0, "planned requests are never preempted");
        r.transition(RequestStatus::Preempted)
            .expect("running requests can be preempted");
        self.kv.shrink(r.num_computed, r.num_computed);
        r.num_computed = 0;
        r.num_cached = 0; // its assembled cache is dropped with the rest
        self.waiting.push_front(id);
        plan.preempted.push(id);
    }

    fn reserve(&mut self, id: RequestId, tokens: u32) {
        let r = self
            .requests
            .get_mut(id)
            .expect("planned requests are live");
        self.kv.grow(r.kv_held(), tokens);
        if r.num_scheduled == 0 {
            self.inflight.push(id);
        }
        r.num_scheduled += tokens;
    }

    /// Ends a live request (any state → `Finished(Aborted)`); frees its KV. `false` if
    /// it already ended or never existed (aborts race with natural ends).
    pub fn abort(&mut self, id: RequestId) -> bool {
        self.finish(id, FinishReason::Aborted)
    }

    /// Ends a live request for a reason decided outside the scheduler (a stop string,
    /// an engine error). `false` if it already ended or never existed.
    pub fn finish(&mut self, id: RequestId, reason: FinishReason) -> bool {
        let Some(r) = self.requests.get(id) else {
            return false;
        };
        let queue_pos = match r.status() {
            RequestStatus::Running => self.running.iter().position(|&x| x == id),
            _ => self.waiting.iter().position(|&x| x == id),
        };
        match (r.status(), queue_pos) {
            (RequestStatus::Running, Some(pos)) => {
                self.running.remove(pos);
            }
            (_, Some(pos)) => {
                self.waiting.remove(pos);
            }
            (_, None) => unreachable!("live request {id} is in no queue"),
        }
        let planned = r.num_scheduled > 0;
        let ended = self.end(id, reason);
        if planned {
            self.ended_inflight.push((ended.external_id, id));
        }
        self.debug_check();
        true
    }

    /// Moves a live request to `Finished`, frees its KV and forgets it. The caller
    /// takes it out of its queue.
    fn end(&mut self, id: RequestId, reason: FinishReason) -> Finished {
        let mut r = self.requests.remove(id).expect("ending a live request");
        r.transition(RequestStatus::Finished(reason))
            .expect("live requests are never finished");
        let held = r.kv_held();
        self.kv.shrink(held, held);
        Finished {
            id,
            external_id: r.external_id,
            reason,
            num_output: r.num_output,
        }
    }

    fn req(&self, id: RequestId) -> &Request {
        self.requests.get(id).expect("queued requests are live")
    }

    fn req_mut(&mut self, id: RequestId) -> &mut Request {
        self.requests.get_mut(id).expect("queued requests are live")
    }
}
