//! One scheduler step — `schedule()` + `update()` — with 256 requests decoding: the
//! fixed per-step cost the engine pays on top of the forward pass.

use std::time::{Duration, Instant};

use compat_core::scheduler::{NewRequest, RequestId, Scheduler, SchedulerConfig, StepResult};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};

const RUNNING: usize = 256;
const PROMPT: u32 = 1024;
const TOKEN: u32 = 7;

/// 256 requests, all prefilled and decoding; they never finish (no stop token is
/// sampled, and the limits are out of reach).
fn decoding_scheduler() -> Scheduler {
    let mut s = Scheduler::new(SchedulerConfig {
        max_num_seqs: RUNNING,
        max_num_batched_tokens: 8192,
        prefill_chunk: 512,
        decode_prefill_chunk: u32::MAX,
        kv_capacity_tokens: 1 << 40,
        context_length: u32::MAX,
    })
    .expect("valid config");
    for i in 0..RUNNING {
        s.add_request(NewRequest {
            external_id: format!("req-{i}"),
            prompt_len: PROMPT,
            max_tokens: u32::MAX,
            stop_token_ids: vec![2],
            cached_tokens: 0,
        })
        .expect("request fits");
    }
    loop {
        let plan = s.schedule().expect("schedules");
        if plan.prefill.is_empty() && plan.decode.len() == RUNNING {
            // Complete this decode step so the benchmark starts between steps.
            step_result(&plan.decode, &mut StepResult::default(), &mut s);
            return s;
        }
        let mut result = StepResult::default();
        for w in &plan.prefill {
            result.prefilled.push((w.id, w.len));
            if w.is_last_chunk {
                result.sampled.push((w.id, TOKEN));
            }
        }
        result
            .sampled
            .extend(plan.decode.iter().map(|&id| (id, TOKEN)));
        s.update(&result).expect("updates");
    }
}

fn step_result(decode: &[RequestId], result: &mut StepResult, s: &mut Scheduler) {
    result.sampled.clear();
    result.sampled.extend(decode.iter().map(|&id| (id, TOKEN)));
    let finished = s.update(result).expect("updates");
    debug_assert!(finished.is_empty());
}

fn one_step(s: &mut Scheduler, result: &mut StepResult) {
    let plan = s.schedule().expect("schedules");
    debug_assert_eq!(plan.decode.len(), RUNNING);
    step_result(&plan.decode, result, s);
}

fn bench(c: &mut Criterion) {
    let mut s = decoding_scheduler();
    let mut result = StepResult::default();

    let start = Instant::now();
    let mut steps = 0u32;
    while start.elapsed() < Duration::from_secs(1) {
        one_step(&mut s, &mut result);
        steps += 1;
    }
    let us_per_step = start.elapsed().as_secs_f64() * 1e6 / f64::from(steps);
    println!(
        "scheduler_step: {RUNNING} running requests decoding: {us_per_step:.2} us per \
         schedule()+update() ({:.0} ns per request)",
        us_per_step * 1e3 / RUNNING as f64
    );

    let mut group = c.benchmark_group("scheduler_step");
    group.throughput(Throughput::Elements(1));
    group.bench_function("decode_256", |b| b.iter(|| one_step(&mut s, &mut result)));
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
