//! Scenario tests of the scheduling policy; transitions are tested in `request.rs`,
//! random sequences in `proptests.rs`.
use super::*;

const EOS: u32 = 2;
const TOKEN: u32 = 7;

fn config() -> SchedulerConfig {
    SchedulerConfig {
        max_num_seqs: 4,
        max_num_batched_tokens: 16,
        prefill_chunk: 8,
        decode_prefill_chunk: u32::MAX,
        kv_capacity_tokens: 64,
        context_length: 100,
    }
}

fn scheduler(config: SchedulerConfig) -> Scheduler {
    Scheduler::new(config).unwrap()
}

fn add(s: &mut Scheduler, name: &str, prompt_len: u32, max_tokens: u32) -> RequestId {
    s.add_request(NewRequest {
        external_id: name.into(),
        prompt_len,
        max_tokens,
        stop_token_ids: vec![EOS],
        cached_tokens: 0,
    })
    .unwrap()
}

/// What a faithful engine reports for `plan`: every prefill in full, a sampled token
/// for every decode and every last chunk.
fn full_result(s: &Scheduler, plan: &StepPlan, token: impl Fn(RequestId) -> u32) -> StepResult {
    let mut result = StepResult::default();
    for w in &plan.prefill {
        result.prefilled.push((w.id, w.len));
        if w.is_last_chunk && s.request(w.id).is_some_and(|r| r.max_tokens > 0) {
            result.sampled.push((w.id, token(w.id)));
        }
    }
    result
        .sampled
        .extend(plan.decode.iter().map(|&id| (id, token(id))));
    result
}

fn step(s: &mut Scheduler) -> (StepPlan, Vec<Finished>) {
    let plan = s.schedule().unwrap();
    let result = full_result(s, &plan, |_| TOKEN);
    let finished = s.update(&result).unwrap();
    (plan, finished)
}

fn chunks(plan: &StepPlan) -> Vec<(u32, u32, bool)> {
    plan.prefill
        .iter()
        .map(|w| (w.start, w.len, w.is_last_chunk))
        .collect()
}

#[test]
fn add_request_rejects_duplicates_empty_and_oversized_prompts() {
    let mut s = scheduler(config());
    add(&mut s, "a", 4, 4);
    let dup = s
        .add_request(NewRequest {
            external_id: "a".into(),
            prompt_len: 1,
            max_tokens: 1,
            stop_token_ids: vec![],
            cached_tokens: 0,
        })
        .unwrap_err();
    assert!(
        matches!(dup, CoreError::DuplicateRequest(ref id) if id == "a"),
        "{dup}"
    );
    for prompt_len in [0, 65, 1000] {
        let err = s
            .add_request(NewRequest {
                external_id: "b".into(),
                prompt_len,
                max_tokens: 1,
                stop_token_ids: vec![],
                cached_tokens: 0,
            })
            .unwrap_err();
        assert!(matches!(err, CoreError::InvalidInput(_)), "{err}");
    }
    // 64 tokens of KV: a 64-token prompt fits and samples one token.
    add(&mut s, "b", 64, 1);
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn chunked_prefill_then_decode_until_max_tokens() {
    let mut s = scheduler(config());
    let id = add(&mut s, "a", 20, 3);
    let (plan, done) = step(&mut s);
    assert_eq!(chunks(&plan), vec![(0, 8, false)]);
    assert!(done.is_empty());
    assert_eq!(s.kv_used(), 8);
    assert_eq!(chunks(&step(&mut s).0), vec![(8, 8, false)]);
    let (plan, _) = step(&mut s);
    assert_eq!(chunks(&plan), vec![(16, 4, true)]);
    assert_eq!(s.request(id).unwrap().num_output, 1);
    let (plan, done) = step(&mut s);
    assert_eq!(plan.decode, vec![id]);
    assert!(done.is_empty());
    assert_eq!(s.kv_used(), 21);
    let (_, done) = step(&mut s);
    assert_eq!(
        done,
        vec![Finished {
            id,
            external_id: "a".into(),
            reason: FinishReason::MaxTokens,
            num_output: 3
        }]
    );
    assert_eq!((s.kv_used(), s.num_running(), s.num_waiting()), (0, 0, 0));
    assert_eq!(s.lookup("a"), None, "finished requests are forgotten");
    assert!(!s.abort(id), "and end only once");
    assert!(s.schedule().unwrap().is_idle());
}

#[test]
fn stop_token_ends_the_request() {
    let mut s = scheduler(config());
    let id = add(&mut s, "a", 4, 10);
    step(&mut s);
    let plan = s.schedule().unwrap();
    let done = s.update(&full_result(&s, &plan, |_| EOS)).unwrap();
    assert_eq!(done[0].reason, FinishReason::StopToken);
    assert_eq!(done[0].num_output, 2, "the stop token counts as output");
    assert!(s.request(id).is_none());
}

#[test]
fn context_window_ends_the_request() {
    let mut s = scheduler(SchedulerConfig {
        context_length: 10,
        ..config()
    });
    add(&mut s, "a", 8, 100);
    let (_, done) = step(&mut s);
    assert!(done.is_empty());
    let (_, done) = step(&mut s);
    assert_eq!(done[0].reason, FinishReason::ContextFull);
    assert_eq!(done[0].num_output, 2);
}

#[test]
fn kv_capacity_bounds_a_lone_sequence_like_a_context_window() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 10,
        ..config()
    });
    add(&mut s, "a", 8, 100);
    let mut finished = Vec::new();
    while finished.is_empty() {
        finished = step(&mut s).1;
    }
    assert_eq!(finished[0].reason, FinishReason::ContextFull);
    assert_eq!(
        finished[0].num_output, 3,
        "8 + 3 tokens: the last needs no KV"
    );
}

#[test]
fn max_tokens_zero_finishes_after_the_prompt_without_a_sample() {
    let mut s = scheduler(config());
    add(&mut s, "a", 12, 0);
    assert!(step(&mut s).1.is_empty());
    let (plan, done) = step(&mut s);
    assert_eq!(chunks(&plan), vec![(8, 4, true)]);
    assert_eq!(done[0].reason, FinishReason::MaxTokens);
    assert_eq!(s.kv_used(), 0);
}

#[test]
fn decode_goes_first_and_prefill_gets_the_rest_of_the_budget() {
    let mut s = scheduler(SchedulerConfig {
        prefill_chunk: 16,
        decode_prefill_chunk: u32::MAX,
        ..config()
    });
    let a = add(&mut s, "a", 4, 100);
    let b = add(&mut s, "b", 4, 100);
    step(&mut s); // both prefill and sample their first token
    let c = add(&mut s, "c", 40, 100);
    let (plan, _) = step(&mut s);
    assert_eq!(plan.decode, vec![a, b]);
    assert_eq!(plan.prefill[0].id, c);
    assert_eq!(chunks(&plan), vec![(0, 14, false)]);
    assert_eq!(plan.num_tokens(), 16);
    let (plan, _) = step(&mut s);
    assert_eq!(plan.decode, vec![a, b]);
    assert_eq!(chunks(&plan), vec![(14, 14, false)]);
}

#[test]
fn a_step_that_decodes_prefills_at_most_the_decode_chunk() {
    let mut s = scheduler(SchedulerConfig {
        max_num_batched_tokens: 64,
        prefill_chunk: 16,
        decode_prefill_chunk: 6,
        kv_capacity_tokens: 256,
        ..config()
    });
    let c = add(&mut s, "c", 40, 100);
    let (plan, _) = step(&mut s);
    assert_eq!(
        chunks(&plan),
        vec![(0, 16, false)],
        "nobody decodes: a full chunk"
    );
    let (plan, _) = step(&mut s);
    assert_eq!(chunks(&plan), vec![(16, 16, false)]);
    let a = add(&mut s, "a", 3, 100);
    let (plan, _) = step(&mut s);
    assert!(plan.decode.is_empty());
    assert_eq!(
        plan.prefill.iter().map(|w| w.id).collect::<Vec<_>>(),
        vec![c, a]
    );
    assert_eq!(chunks(&plan), vec![(32, 8, true), (0, 3, true)]);
    let b = add(&mut s, "b", 20, 100);
    let (plan, _) = step(&mut s);
    assert_eq!(plan.decode, vec![c, a]);
    assert_eq!(plan.prefill[0].id, b);
    assert_eq!(
        chunks(&plan),
        vec![(0, 6, false)],
        "others decode: the smaller chunk"
    );
}

#[test]
fn admission_is_fifo_and_bounded_by_max_num_seqs() {
    let mut s = scheduler(SchedulerConfig {
        max_num_batched_tokens: 64,
        ..config()
    });
    let ids: Vec<_> = (0..6)
        .map(|i| add(&mut s, &format!("r{i}"), 2, 100))
        .collect();
    let (plan, _) = step(&mut s);
    let admitted: Vec<_> = plan.prefill.iter().map(|w| w.id).collect();
    assert_eq!(admitted, ids[..4]);
    assert_eq!((s.num_running(), s.num_waiting()), (4, 2));
    assert!(s.abort(ids[1]));
    let (plan, _) = step(&mut s);
    assert_eq!(
        plan.prefill[0].id, ids[4],
        "the oldest waiting request comes next"
    );
    assert_eq!(plan.decode, vec![ids[0], ids[2], ids[3]]);
}

#[test]
fn the_head_of_the_queue_blocks_smaller_requests_behind_it() {
    let mut s = scheduler(SchedulerConfig {
        prefill_chunk: 16,
        decode_prefill_chunk: u32::MAX,
        ..config()
    });
    add(&mut s, "big", 50, 100);
    while s.request(s.lookup("big").unwrap()).unwrap().num_output == 0 {
        step(&mut s);
    }
    assert_eq!(s.kv_used(), 50);
    // The head's first chunk is 15 tokens (the budget left after the decode); 13 are free.
    add(&mut s, "head", 16, 1);
    add(&mut s, "small", 2, 1);
    let (plan, _) = step(&mut s);
    assert!(plan.prefill.is_empty(), "no overtaking: {plan:?}");
    assert_eq!(s.num_waiting(), 2);
}

#[test]
fn admission_waits_until_the_whole_prompt_fits() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 20,
        ..config()
    });
    let a = add(&mut s, "a", 6, 3);
    step(&mut s);
    add(&mut s, "b", 15, 1);
    let (plan, _) = step(&mut s); // 13 free after a's decode: a first chunk of 8 would fit
    assert_eq!(plan.decode, vec![a]);
    assert!(plan.prefill.is_empty(), "{plan:?}");
    let (_, done) = step(&mut s);
    assert_eq!(done[0].id, a);
    assert_eq!(chunks(&step(&mut s).0), vec![(0, 8, false)]);
}

#[test]
fn kv_pressure_preempts_the_newest_which_recomputes_prompt_and_output() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 24,
        ..config()
    });
    let a = add(&mut s, "a", 8, 100);
    let b = add(&mut s, "b", 8, 100);
    step(&mut s); // a: 8 computed, b: 8 computed; both sampled one token
    let mut decodes = 0;
    let plan = loop {
        let (plan, _) = step(&mut s);
        if !plan.preempted.is_empty() {
            break plan;
        }
        assert_eq!(plan.decode, vec![a, b]);
        decodes += 1;
    };
    // 24 tokens of KV: a and b each grow by one per step from 8.
    assert_eq!(decodes, 4);
    assert_eq!(plan.preempted, vec![b]);
    assert_eq!(plan.decode, vec![a]);
    assert!(
        plan.prefill.is_empty(),
        "no admission in a step that preempted"
    );
    let snapshot = s.snapshot();
    assert_eq!(snapshot[1].status, RequestStatus::Preempted);
    assert_eq!((snapshot[1].num_computed, snapshot[1].num_output), (0, 5));
    assert_eq!(s.kv_used(), 13);
    // b comes back once a is gone, recomputing its 8 + 5 tokens.
    assert!(s.finish(a, FinishReason::External));
    let (plan, _) = step(&mut s);
    assert_eq!(plan.prefill[0].id, b);
    assert_eq!(chunks(&plan), vec![(0, 8, false)]);
    let (plan, _) = step(&mut s);
    assert_eq!(chunks(&plan), vec![(8, 5, true)]);
    assert_eq!(s.request(b).unwrap().num_output, 6);
    assert_eq!(step(&mut s).0.decode, vec![b]);
}

#[test]
fn the_newest_decode_preempts_itself_for_an_older_prefill() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 10,
        ..config()
    });
    let a = add(&mut s, "a", 9, 100);
    let b = add(&mut s, "b", 2, 100);
    let (plan, _) = step(&mut s);
    assert_eq!(chunks(&plan), vec![(0, 8, false), (0, 2, true)]);
    let (plan, _) = step(&mut s); // KV full: b decodes next, but a is older
    assert_eq!(plan.preempted, vec![b]);
    assert!(plan.decode.is_empty());
    assert_eq!(plan.prefill[0].id, a);
    assert_eq!(chunks(&plan), vec![(8, 1, true)]);
}

#[test]
fn preempted_requests_return_to_the_front_in_admission_order() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 12,
        max_num_batched_tokens: 64,
        ..config()
    });
    for name in ["r0", "r1", "r2", "late"] {
        add(&mut s, name, 3, 100);
    }
    let mut preempted = Vec::new();
    while s.num_running() != 1 {
        let (plan, _) = step(&mut s);
        preempted.extend(
            plan.preempted
                .iter()
                .map(|&id| s.external_id(id).unwrap().to_owned()),
        );
    }
    assert_eq!(preempted, ["late", "r2", "r1"]);
    let order: Vec<_> = s.snapshot().into_iter().map(|r| r.external_id).collect();
    assert_eq!(order, ["r0", "r1", "r2", "late"]);
}

#[test]
fn abort_works_in_every_live_state_and_frees_kv() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 10,
        ..config()
    });
    let running = add(&mut s, "running", 4, 100);
    let preempted = add(&mut s, "preempted", 4, 100);
    step(&mut s);
    while s.snapshot()[1].status != RequestStatus::Preempted {
        step(&mut s);
    }
    let waiting = add(&mut s, "waiting", 4, 100);
    for id in [waiting, preempted, running] {
        assert!(s.abort(id));
        assert!(!s.abort(id));
        assert!(!s.finish(id, FinishReason::External));
        s.check_invariants().unwrap();
    }
    assert_eq!((s.kv_used(), s.num_running(), s.num_waiting()), (0, 0, 0));
}

#[test]
fn results_for_requests_ended_after_the_plan_are_ignored() {
    let mut s = scheduler(config());
    let a = add(&mut s, "a", 4, 100);
    let b = add(&mut s, "b", 4, 100);
    let plan = s.schedule().unwrap();
    let result = full_result(&s, &plan, |_| TOKEN);
    assert!(s.abort(a));
    assert_eq!(s.lookup("a"), Some(a), "still resolvable until update");
    assert!(s.update(&result).unwrap().is_empty());
    assert_eq!(s.lookup("a"), None);
    assert_eq!(s.request(b).unwrap().num_output, 1);
    assert_eq!(s.kv_used(), 4);
}

#[test]
fn schedule_and_update_alternate() {
    let mut s = scheduler(config());
    add(&mut s, "a", 4, 100);
    let plan = s.schedule().unwrap();
    assert!(matches!(s.schedule(), Err(CoreError::InvalidStep(_))));
    s.update(&full_result(&s, &plan, |_| TOKEN)).unwrap();
    let stale = full_result(&s, &plan, |_| TOKEN);
    assert!(matches!(s.update(&stale), Err(CoreError::InvalidStep(_))));
    assert!(s.update(&StepResult::default()).unwrap().is_empty());
}

#[test]
fn a_bad_result_changes_nothing_and_can_be_retried() {
    let mut s = scheduler(config());
    let a = add(&mut s, "a", 4, 100);
    let b = add(&mut s, "b", 12, 100);
    let plan = s.schedule().unwrap();
    let good = full_result(&s, &plan, |_| TOKEN);
    let bad_results = [
        StepResult {
            prefilled: vec![(a, 4)],
            ..good.clone()
        }, // b missing
        StepResult {
            sampled: vec![],
            ..good.clone()
        }, // a reached its end
        StepResult {
            prefilled: vec![(a, 5), (b, 8)],
            ..good.clone()
        },
        StepResult {
            prefilled: vec![(a, 3), (b, 8)],
            ..good.clone()
        }, // sampled early
        StepResult {
            sampled: vec![(a, 1), (b, 1)],
            ..good.clone()
        },
        StepResult {
            sampled: vec![(a, 1), (a, 1)],
            ..good.clone()
        },
        StepResult {
            sampled: vec![(RequestId::new(9, 0), 1)],
            ..good.clone()
        },
    ];
    for bad in &bad_results {
        let err = s.update(bad).unwrap_err();
        assert!(
            matches!(
                err,
                CoreError::InvalidStep(_) | CoreError::UnknownRequest(_)
            ),
            "{err}"
        );
        s.check_invariants().unwrap();
        assert_eq!(s.kv_used(), 12, "the reservation stands");
    }
    s.update(&good).unwrap();
    assert_eq!(s.request(a).unwrap().num_output, 1);
}

#[test]
fn a_short_prefill_report_is_planned_again() {
    let mut s = scheduler(config());
    let a = add(&mut s, "a", 12, 100);
    let plan = s.schedule().unwrap();
    assert_eq!(chunks(&plan), vec![(0, 8, false)]);
    s.update(&StepResult {
        prefilled: vec![(a, 3)],
        sampled: vec![],
    })
    .unwrap();
    assert_eq!(s.kv_used(), 3);
    assert_eq!(chunks(&s.schedule().unwrap()), vec![(3, 8, false)]);
}

#[test]
fn snapshot_lists_running_then_waiting() {
    let mut s = scheduler(SchedulerConfig {
        max_num_seqs: 1,
        ..config()
    });
    add(&mut s, "a", 4, 100);
    add(&mut s, "b", 4, 100);
    step(&mut s);
    let rows: Vec<_> = s
        .snapshot()
        .into_iter()
        .map(|r| (r.external_id, r.status, r.num_computed, r.num_output))
        .collect();
    assert_eq!(
        rows,
        vec![
            ("a".into(), RequestStatus::Running, 4, 1),
            ("b".into(), RequestStatus::Waiting, 0, 0)
        ]
    );
}

fn limits(batched: u32, chunk: u32, kv: u64) -> SchedulerConfig {
    SchedulerConfig {
        max_num_batched_tokens: batched,
        prefill_chunk: chunk,
        decode_prefill_chunk: u32::MAX,
        kv_capacity_tokens: kv,
        context_length: 512,
        ..config()
    }
}

#[test]
fn a_prefix_cache_hit_prefills_only_the_rest_and_holds_kv_for_all() {
    let mut s = scheduler(limits(64, 16, 1000));
    let id = s
        .add_request(NewRequest {
            external_id: "hit".into(),
            prompt_len: 40,
            max_tokens: 3,
            stop_token_ids: vec![EOS],
            cached_tokens: 32,
        })
        .unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(
        plan.prefill,
        vec![PrefillWork {
            id,
            start: 32,
            len: 8,
            is_last_chunk: true
        }]
    );
    assert_eq!(plan.num_tokens(), 8);
    assert_eq!(s.kv_used(), 40);
    s.update(&StepResult {
        prefilled: vec![(id, 8)],
        sampled: vec![(id, 7)],
    })
    .unwrap();
    assert_eq!(s.request(id).unwrap().num_computed(), 40);
    s.check_invariants().unwrap();
}

#[test]
fn a_cache_hit_must_leave_a_token_to_compute() {
    let mut s = scheduler(limits(64, 16, 1000));
    let err = s
        .add_request(NewRequest {
            external_id: "all".into(),
            prompt_len: 40,
            max_tokens: 3,
            stop_token_ids: vec![],
            cached_tokens: 40,
        })
        .unwrap_err();
    assert!(err.to_string().contains("at least one token"), "{err}");
}

#[test]
fn a_preempted_cache_hit_recomputes_from_zero() {
    // KV for 50 tokens: the hit (40 + decode) and a second request cannot both grow.
    let mut s = scheduler(limits(64, 64, 50));
    let a = s
        .add_request(NewRequest {
            external_id: "a".into(),
            prompt_len: 20,
            max_tokens: 100,
            stop_token_ids: vec![],
            cached_tokens: 0,
        })
        .unwrap();
    let b = s
        .add_request(NewRequest {
            external_id: "b".into(),
            prompt_len: 25,
            max_tokens: 100,
            stop_token_ids: vec![],
            cached_tokens: 16,
        })
        .unwrap();
    let plan = s.schedule().unwrap();
    assert_eq!(plan.prefill.len(), 2);
    assert_eq!((plan.prefill[1].id, plan.prefill[1].start), (b, 16));
    s.update(&StepResult {
        prefilled: vec![(a, 20), (b, 9)],
        sampled: vec![(a, 1), (b, 1)],
    })
    .unwrap();
    let mut preempted = None;
    for _ in 0..10 {
        let plan = s.schedule().unwrap();
        if !plan.preempted.is_empty() {
            preempted = Some(plan.preempted.clone());
            let sampled: Vec<_> = plan.decode.iter().map(|&id| (id, 1)).collect();
            s.update(&StepResult {
                prefilled: vec![],
                sampled,
            })
            .unwrap();
            break;
        }
        let sampled: Vec<_> = plan.decode.iter().map(|&id| (id, 1)).collect();
        s.update(&StepResult {
            prefilled: vec![],
            sampled,
        })
        .unwrap();
    }
    assert_eq!(preempted, Some(vec![b]));
    s.check_invariants().unwrap();
    // Re-admitted later, it starts from 0, not from its old hit.
    s.abort(a);
    let plan = s.schedule().unwrap();
    assert_eq!(plan.prefill[0].id, b);
    assert_eq!(plan.prefill[0].start, 0);
}

#[test]
fn a_decoding_request_may_report_several_speculated_tokens() {
    let mut s = scheduler(config());
    let a = add(&mut s, "a", 4, 10);
    step(&mut s); // prefill + first token
    let plan = s.schedule().unwrap();
    assert_eq!(plan.decode, vec![a]);
    let used = s.kv_used();
    let result = StepResult {
        prefilled: vec![],
        sampled: vec![(a, 11), (a, 12), (a, 13)],
    };
    assert!(s.update(&result).unwrap().is_empty());
    let r = s.request(a).unwrap();
    assert_eq!((r.num_output(), r.num_computed()), (4, 7));
    assert_eq!(s.kv_used(), used + 2);
    s.check_invariants().unwrap();
    // The last of several tokens may end it.
    s.schedule().unwrap();
    let result = StepResult {
        prefilled: vec![],
        sampled: vec![(a, 11), (a, EOS)],
    };
    let finished = s.update(&result).unwrap();
    assert_eq!(finished[0].reason, FinishReason::StopToken);
    assert_eq!(finished[0].num_output, 6);
    assert_eq!(s.kv_used(), 0);
}

#[test]
fn speculated_tokens_past_the_end_or_the_kv_are_rejected_atomically() {
    let mut s = scheduler(SchedulerConfig {
        kv_capacity_tokens: 12,
        ..config()
    });
    let a = add(&mut s, "a", 4, 5);
    step(&mut s);
    s.schedule().unwrap();
    let used = s.kv_used();
    let bad = [
        vec![(a, EOS), (a, 11)], // a stop token before the last
        vec![(a, 11), (a, 11), (a, 11), (a, 11), (a, 11)], // past max_tokens
    ];
    for sampled in bad {
        let result = StepResult {
            prefilled: vec![],
            sampled,
        };
        assert!(matches!(s.update(&result), Err(CoreError::InvalidStep(_))));
        assert_eq!(s.kv_used(), used);
    }
    // Exactly up to max_tokens is fine.
    let result = StepResult {
        prefilled: vec![],
        sampled: vec![(a, 11), (a, 11), (a, 11), (a, 11)],
    };
    let finished = s.update(&result).unwrap();
    assert_eq!(finished[0].reason, FinishReason::MaxTokens);

    // KV: 12 tokens, a prompt of 9 plus the first token leaves 2 free.
    let b = add(&mut s, "b", 9, 20);
    step(&mut s); // 8 of 9 (the prefill chunk)
    step(&mut s); // the last one and the first token
    s.schedule().unwrap();
    assert_eq!(s.kv_headroom(), 2);
    let result = StepResult {
        prefilled: vec![],
        sampled: vec![(b, 11), (b, 11), (b, 11), (b, 11)],
    };
    assert!(matches!(s.update(&result), Err(CoreError::InvalidStep(_))));
    let result = StepResult {
        prefilled: vec![],
        sampled: vec![(b, 11), (b, 11)],
    };
    assert!(s.update(&result).unwrap().is_empty());
    s.check_invariants().unwrap();
}
