//! The scheduler's invariants, checked in full after every operation in debug builds
//! and by the property tests.
use std::collections::HashSet;

use super::request::Report;
use super::{KvBudget, RequestStatus, Scheduler};
use crate::error::CoreError;

impl<K: KvBudget> Scheduler<K> {
    /// Every structural invariant, checked in full (for tests and debug builds).
    pub fn check_invariants(&self) -> Result<(), CoreError> {
        let broken = |msg: String| Err(CoreError::BrokenInvariant(msg));
        if self.running.len() > self.config.max_num_seqs {
            return broken(format!("{} running > max_num_seqs", self.running.len()));
        }
        if self.running.len() + self.waiting.len() != self.requests.len() {
            return broken("a live request is in no queue, or in two".into());
        }
        let mut seen = HashSet::with_capacity(self.requests.len());
        let mut kv_expected = 0u64;
        for &id in &self.running {
            let Some(r) = self.requests.get(id) else {
                return broken(format!("running {id} is not live"));
            };
            if r.status() != RequestStatus::Running {
                return broken(format!("running {id} has status {}", r.status()));
            }
            if r.kv_held() > r.num_tokens() {
                return broken(format!("{id} holds KV for more tokens than it has"));
            }
            if r.num_scheduled == 0 && r.num_computed >= r.num_tokens() {
                return broken(format!("running {id} has nothing left to compute"));
            }
            kv_expected += self.kv.usage_for(r.kv_held());
            if !seen.insert(id) {
                return broken(format!("{id} is running twice"));
            }
        }
        for &id in &self.waiting {
            let Some(r) = self.requests.get(id) else {
                return broken(format!("waiting {id} is not live"));
            };
            if !matches!(
                r.status(),
                RequestStatus::Waiting | RequestStatus::Preempted
            ) {
                return broken(format!("waiting {id} has status {}", r.status()));
            }
            if r.kv_held() != 0 {
                return broken(format!("waiting {id} holds KV"));
            }
            if !seen.insert(id) {
                return broken(format!("{id} is queued twice"));
            }
        }
        if self.kv.used() != kv_expected {
            return broken(format!("KV used {} != held {kv_expected}", self.kv.used()));
        }
        if self.kv.used() > self.kv.capacity() {
            return broken(format!("KV used {} > capacity", self.kv.used()));
        }
        for (id, r) in self.requests.iter() {
            if r.num_output >= r.max_tokens.max(1) || r.num_tokens() >= self.token_limit {
                return broken(format!("{id} is past its limits but live"));
            }
            if r.num_scheduled > 0 && !self.inflight.contains(&id) {
                return broken(format!("{id} has planned tokens outside the plan"));
            }
            if r.report != Report::default() {
                return broken(format!("{id} has a stale report"));
            }
        }
        Ok(())
    }

    pub(super) fn debug_check(&self) {
        if cfg!(debug_assertions) {
            if let Err(err) = self.check_invariants() {
                panic!("{err}");
            }
        }
    }
}
