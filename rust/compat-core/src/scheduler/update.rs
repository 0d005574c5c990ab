//! Applying the engine's result for the outstanding plan: `update()` files each reported
//! token with its request, checks every report against the plan (nothing changes if one
//! is wrong), then commits KV, appends the tokens and ends the requests that finished.
use super::request::Report;
use super::{FinishReason, Finished, KvBudget, Scheduler, StepResult};
use crate::error::CoreError;

impl<K: KvBudget> Scheduler<K> {
    /// Commits the engine's result for the outstanding plan; returns the requests that
    /// finished, each exactly once. On error nothing changes and the plan stays
    /// outstanding.
    pub fn update(&mut self, result: &StepResult) -> Result<Vec<Finished>, CoreError> {
        if let Err(err) = self.gather(result).and_then(|()| self.validate_reports()) {
            for &id in &self.inflight {
                if let Some(r) = self.requests.get_mut(id) {
                    r.report = Report::default();
                }
            }
            return Err(err);
        }
        let finished = self.commit();
        self.debug_check();
        Ok(finished)
    }

    /// Files each reported entry with its request.
    fn gather(&mut self, result: &StepResult) -> Result<(), CoreError> {
        let entries = result
            .prefilled
            .iter()
            .map(|&(id, n)| (id, n, true))
            .chain(result.sampled.iter().map(|&(id, t)| (id, t, false)));
        for (id, value, is_prefill) in entries {
            let Some(r) = self.requests.get_mut(id) else {
                if self.ended_inflight.iter().any(|&(_, ended)| ended == id) {
                    continue;
                }
                return Err(CoreError::UnknownRequest(id.to_string()));
            };
            let what = if is_prefill { "prefilled" } else { "sampled" };
            if r.num_scheduled == 0 {
                return Err(CoreError::InvalidStep(format!(
                    "request {:?} is {what} but was not planned in this step",
                    r.external_id
                )));
            }
            if !is_prefill && r.is_decoding() {
                // Speculative decoding: a decoding request may report several tokens, in
                // order; each one before the last must leave it running.
                if let Some(previous) = r.report.sampled.replace(value) {
                    r.report.extra += 1;
                    r.report.ended_early |= r.stop_token_ids.contains(&previous);
                }
                continue;
            }
            let slot = if is_prefill {
                &mut r.report.prefilled
            } else {
                &mut r.report.sampled
            };
            if slot.replace(value).is_some() {
                return Err(CoreError::InvalidStep(format!(
                    "request {:?} is {what} twice",
                    r.external_id
                )));
            }
        }
        Ok(())
    }

    /// Checks each planned request's report against its plan.
    fn validate_reports(&self) -> Result<(), CoreError> {
        let mut extra_kv = 0u32;
        for &id in &self.inflight {
            let Some(r) = self.requests.get(id) else {
                continue;
            };
            let bad = |msg: String| {
                Err(CoreError::InvalidStep(format!(
                    "request {:?}: {msg}",
                    r.external_id
                )))
            };
            let report = r.report;
            if r.is_decoding() {
                if report.prefilled.is_some() {
                    return bad("decodes: report its token in sampled, not prefilled".into());
                }
                if report.sampled.is_none() {
                    return bad("decoded but no token was sampled".into());
                }
                let extra = report.extra;
                if extra > 0 {
                    // Every token but the last must leave the request running.
                    let after = r.num_output + extra;
                    if report.ended_early
                        || after >= r.max_tokens
                        || r.prompt_len + after >= self.token_limit
                    {
                        return bad(format!("{} tokens reported past its end", extra + 1));
                    }
                    extra_kv += extra;
                }
                continue;
            }
            let Some(n) = report.prefilled else {
                return bad(format!(
                    "prefill of {} tokens not reported",
                    r.num_scheduled
                ));
            };
            if n > r.num_scheduled {
                return bad(format!("prefilled {n} tokens, {} planned", r.num_scheduled));
            }
            let reaches_end = r.num_computed + n == r.num_tokens();
            match report.sampled {
                None if reaches_end && r.max_tokens > 0 => {
                    return bad("prefill reached the last token but nothing was sampled".into());
                }
                Some(_) if !reaches_end => {
                    return bad("sampled before the prefill reached the last token".into());
                }
                // With max_tokens == 0 a sample is allowed and dropped.
                _ => {}
            }
        }
        if extra_kv > self.kv.headroom(0) {
            return Err(CoreError::InvalidStep(format!(
                "{extra_kv} speculated tokens exceed the free KV ({})",
                self.kv.headroom(0)
            )));
        }
        Ok(())
    }

    /// Applies validated reports: commits KV, appends tokens, ends finished requests.
    fn commit(&mut self) -> Vec<Finished> {
        let mut finished = Vec::new();
        let inflight = std::mem::take(&mut self.inflight);
        for &id in &inflight {
            let Some(r) = self.requests.get_mut(id) else {
                continue;
            };
            let report = std::mem::take(&mut r.report);
            let done = if r.is_decoding() {
                // Accepted draft tokens were computed in the same forward: their KV
                // is committed beyond the one token reserved.
                self.kv.grow(r.kv_held(), report.extra);
                r.num_output += report.extra;
                1 + report.extra
            } else {
                report.prefilled.unwrap_or(0)
            };
            self.kv.shrink(
                r.kv_held() + report.extra,
                r.num_scheduled + report.extra - done,
            );
            r.num_computed += done;
            r.num_scheduled = 0;
            if r.num_computed < r.num_tokens() {
                continue;
            }
            let reason = if r.max_tokens == 0 {
                Some(FinishReason::MaxTokens)
            } else {
                let token = report
                    .sampled
                    .expect("validated: the last token is sampled");
                r.num_output += 1;
                if r.stop_token_ids.contains(&token) {
                    Some(FinishReason::StopToken)
                } else if r.num_output >= r.max_tokens {
                    Some(FinishReason::MaxTokens)
                } else if r.num_tokens() >= self.token_limit {
                    Some(FinishReason::ContextFull)
                } else {
                    None
                }
            };
            if let Some(reason) = reason {
                finished.push(self.end(id, reason));
            }
        }
        if !finished.is_empty() {
            let requests = &self.requests;
            self.running.retain(|&id| requests.get(id).is_some());
        }
        self.inflight = inflight;
        self.inflight.clear(); // keeps the allocation
        self.ended_inflight.clear();
        finished
    }
}
