//! Random sequences of add / step / abort / finish under small capacities (so
//! preemption happens), checking the invariants after every operation and that every
//! request ends exactly once.
use std::collections::HashMap;

use proptest::prelude::*;
use proptest::strategy::ValueTree;
use proptest::test_runner::TestRunner;

use super::*;

const STOP: u32 = 0;

#[derive(Debug, Clone)]
enum Op {
    Add {
        prompt_len: u32,
        max_tokens: u32,
        /// A prefix-cache hit; may exceed the prompt (then the add is refused).
        cached: u32,
    },
    /// One `schedule()` + `update()`; `tokens` feed the samples (0 is the stop token),
    /// `short` makes the engine report fewer prefill tokens than planned, `abort`
    /// aborts a request between the two calls.
    Step {
        tokens: Vec<u32>,
        short: Option<u32>,
        abort: Option<usize>,
    },
    Abort(usize),
    Finish(usize),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (1..40u32, 0..12u32, prop::option::weighted(0.3, 0..40u32)).prop_map(
            |(prompt_len, max_tokens, cached)| Op::Add {
                prompt_len,
                max_tokens,
                cached: cached.unwrap_or(0),
            }
        ),
        6 => (
            prop::collection::vec(0..8u32, 1..8),
            prop::option::weighted(0.2, 0..8u32),
            prop::option::weighted(0.1, any::<usize>()),
        )
            .prop_map(|(tokens, short, abort)| Op::Step { tokens, short, abort }),
        1 => any::<usize>().prop_map(Op::Abort),
        1 => any::<usize>().prop_map(Op::Finish),
    ]
}

fn config() -> impl Strategy<Value = SchedulerConfig> {
    (1..5usize, 0..12u32, 1..12u32, 1..14u32, 4..64u64, 3..80u32).prop_map(
        |(
            max_num_seqs,
            extra_budget,
            prefill_chunk,
            decode_prefill_chunk,
            kv_capacity_tokens,
            context_length,
        )| {
            SchedulerConfig {
                max_num_seqs,
                max_num_batched_tokens: max_num_seqs as u32 + extra_budget,
                prefill_chunk,
                decode_prefill_chunk,
                kv_capacity_tokens,
                context_length,
            }
        },
    )
}

/// Drives a scheduler like the engine would and keeps the books.
struct Harness {
    s: Scheduler,
    added: Vec<(String, RequestId)>,
    ended: HashMap<String, u32>,
    preemptions: u64,
    reasons: HashMap<FinishReason, u32>,
}

impl Harness {
    fn run(config: SchedulerConfig, ops: Vec<Op>) -> Self {
        let mut h = Self {
            s: Scheduler::new(config).unwrap(),
            added: Vec::new(),
            ended: HashMap::new(),
            preemptions: 0,
            reasons: HashMap::new(),
        };
        for op in ops {
            match op {
                Op::Add {
                    prompt_len,
                    max_tokens,
                    cached,
                } => h.add(prompt_len, max_tokens, cached),
                Op::Step {
                    tokens,
                    short,
                    abort,
                } => h.step(&tokens, short, abort),
                Op::Abort(pick) => h.end(pick, FinishReason::Aborted),
                Op::Finish(pick) => h.end(pick, FinishReason::External),
            }
            h.s.check_invariants().unwrap();
        }
        h.drain();
        h
    }

    fn record_end(&mut self, name: &str, reason: FinishReason) {
        *self.ended.entry(name.to_owned()).or_default() += 1;
        *self.reasons.entry(reason).or_default() += 1;
    }

    fn add(&mut self, prompt_len: u32, max_tokens: u32, cached_tokens: u32) {
        let name = format!("r{}", self.added.len());
        let new = NewRequest {
            external_id: name.clone(),
            prompt_len,
            max_tokens,
            stop_token_ids: vec![STOP],
            cached_tokens,
        };
        match self.s.add_request(new) {
            Ok(id) => self.added.push((name, id)),
            Err(err) => assert!(matches!(err, CoreError::InvalidInput(_)), "{err}"),
        }
    }

    fn end(&mut self, pick: usize, reason: FinishReason) {
        if self.added.is_empty() {
            return;
        }
        let (name, id) = self.added[pick % self.added.len()].clone();
        if self.s.finish(id, reason) {
            self.record_end(&name, reason);
        }
    }

    fn step(&mut self, tokens: &[u32], short: Option<u32>, abort: Option<usize>) {
        let config = *self.s.config();
        let before: HashMap<RequestId, (u32, u32)> = self
            .added
            .iter()
            .filter_map(|&(_, id)| {
                let r = self.s.request(id)?;
                // A waiting cache hit starts after its cached tokens.
                Some((id, (r.num_computed.max(r.num_cached), r.num_tokens())))
            })
            .collect();
        let plan = self.s.schedule().unwrap();
        self.preemptions += plan.preempted.len() as u64;
        assert!(plan.num_tokens() <= u64::from(config.max_num_batched_tokens));
        assert!(self.s.num_running() <= config.max_num_seqs);
        let mut seen = Vec::new();
        let chunk = if plan.decode.is_empty() {
            config.prefill_chunk
        } else {
            config.prefill_chunk.min(config.decode_prefill_chunk)
        };
        for w in &plan.prefill {
            assert!(w.len > 0 && w.len <= chunk, "{w:?}");
            let (computed, total) = before[&w.id];
            assert_eq!(w.start, computed, "{w:?}");
            assert_eq!(w.is_last_chunk, w.start + w.len == total, "{w:?}");
            seen.push(w.id);
        }
        seen.extend(&plan.decode);
        let planned = seen.len();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(seen.len(), planned, "a request is planned twice: {plan:?}");
        assert!(plan.preempted.iter().all(|id| !seen.contains(id)));
        self.s.check_invariants().unwrap();

        if let Some(pick) = abort {
            self.end(pick, FinishReason::Aborted);
        }
        let mut token = tokens.iter().copied().cycle();
        let mut result = StepResult::default();
        for w in &plan.prefill {
            let done = short.map_or(w.len, |s| s.min(w.len));
            result.prefilled.push((w.id, done));
            let samples = self.s.request(w.id).is_some_and(|r| r.max_tokens > 0);
            if w.is_last_chunk && done == w.len && samples {
                result.sampled.push((w.id, token.next().unwrap()));
            }
        }
        for &id in &plan.decode {
            result.sampled.push((id, token.next().unwrap()));
        }
        for finished in self.s.update(&result).unwrap() {
            assert!(self.s.request(finished.id).is_none());
            self.record_end(&finished.external_id, finished.reason);
        }
    }

    /// Steps a faithful engine until nothing is left; the policy must make progress.
    fn drain(&mut self) {
        let mut steps = 0;
        while self.s.num_running() + self.s.num_waiting() > 0 {
            self.step(&[5, 6, 7], None, None);
            self.s.check_invariants().unwrap();
            steps += 1;
            assert!(steps < 5_000, "no progress: {:?}", self.s.snapshot());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn random_operations_keep_the_invariants(
        config in config(),
        ops in prop::collection::vec(op(), 1..80),
    ) {
        let h = Harness::run(config, ops);
        prop_assert_eq!(h.s.kv_used(), 0);
        prop_assert_eq!(h.s.requests.len(), 0, "no request is retained");
        prop_assert!(h.s.requests.iter().next().is_none());
        for (name, _) in &h.added {
            prop_assert_eq!(h.ended.get(name).copied(), Some(1), "{} ended once", name);
        }
        prop_assert_eq!(h.ended.len(), h.added.len());
    }
}

/// Guards the generator: the property above is only as good as what it reaches.
#[test]
fn the_generator_reaches_preemption_and_every_finish_reason() {
    let mut runner = TestRunner::deterministic();
    let cases = (config(), prop::collection::vec(op(), 1..80));
    let (mut preemptions, mut reasons) = (0, HashMap::new());
    for _ in 0..200 {
        let (config, ops) = cases.new_tree(&mut runner).unwrap().current();
        let h = Harness::run(config, ops);
        preemptions += h.preemptions;
        for (reason, n) in h.reasons {
            *reasons.entry(reason).or_insert(0) += n;
        }
    }
    assert!(preemptions > 30, "{preemptions} preemptions");
    for reason in FinishReason::ALL {
        assert!(
            reasons.get(&reason).copied().unwrap_or(0) > 10,
            "{reason}: {reasons:?}"
        );
    }
}
