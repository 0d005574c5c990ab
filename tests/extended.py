"""The extended run: slower second views of what `make test` already checks, kept out of
CI's time budget and run by `make test-extended` (COMPAT_SERVE_TEST_EXTENDED=1).

A test marked `extended` is deselected unless the variable is set (tests/conftest.py); a
test that samples a set in CI (the chat templates of four tool formats, say) takes the
whole set when `EXTENDED` is true. Each use says beside it what CI keeps of it.
"""

from __future__ import annotations

import os

__all__ = ["EXTENDED", "EXTENDED_ENV", "EXTENDED_ONLY"]

EXTENDED_ENV = "COMPAT_SERVE_TEST_EXTENDED"
EXTENDED = os.environ.get(EXTENDED_ENV) == "1"

# Second views CI leaves to the extended run, reviewed in one place, each group with what
# CI keeps of it: test ids (a parametrized id names one case, a bare name every case).
# tests/conftest.py marks them `extended`, and refuses an id that names no test.
EXTENDED_ONLY: tuple[str, ...] = (
    # A real client on the embedded model: CI keeps OpenCode's scripted write round trip on
    # both providers (its default bodies, tool call and result), and the embedded model
    # through the Codex and Claude Code CLIs.
    "tests/e2e/test_opencode.py::test_opencode_embedded_model_answers_a_plain_question",
    # Codex and the launcher on the embedded model, and OpenCode's prompts through the
    # envelope: CI keeps Codex's scripted apply_patch and shell round trip, Claude Code's
    # print mode on the embedded model and its scripted bash call, `launch` with a stand-in
    # client (tests/e2e/test_launch.py), and the envelope's unit tests.
    "tests/e2e/test_codex.py::test_codex_embedded_model_creates_the_file",
    "tests/e2e/test_claude_code_tools.py::test_the_embedded_model_calls_bash_through_the_envelope",
    "tests/e2e/test_launch_clients.py::test_claude_code_and_codex_run_on_the_launchers_settings_alone",
    "tests/http/test_envelope_example.py::test_opencode_prompts_answer_without_copying_the_example",
    # SIGTERM: CI keeps in-flight requests finishing and the second signal exiting at once,
    # and `launch` starting, passing the client's exit code and reporting a failed start.
    "tests/e2e/test_graceful_shutdown.py::test_sigterm_ends_what_is_left_at_the_timeout",
    "tests/e2e/test_launch.py::test_sigterm_reaches_the_client_first_then_the_server_stops",
    # The published Gemma file against llama.cpp: CI keeps the users' load (`--dtype
    # quantized`), its greedy continuations, prompt ids and counts, BOS and sliding-window
    # caches; the float32 load (its tokenizer and window are the same code; every tensor
    # type's float32 dequantization is checked on small files, test_gguf_tensor_types.py
    # and test_gguf_families.py) and the prompt past the sliding window run here.
    "tests/llamacpp/test_gemma_vs_llamacpp.py::test_prompt_token_counts_equal_llamacpp[auto]",
    "tests/llamacpp/test_gemma_vs_llamacpp.py::test_gemma_text_starts_with_one_bos_as_llamacpp[auto]",
    "tests/llamacpp/test_gemma_vs_llamacpp.py::test_greedy_continuations_equal_llamacpp[auto]",
    "tests/llamacpp/test_gemma_vs_llamacpp.py::test_gemma3_sliding_layers_keep_a_512_token_window[auto]",
    "tests/llamacpp/test_gemma_vs_llamacpp.py::test_past_the_sliding_window_alone_batched_and_cached[auto]",
    # The published Gemma file tensor by tensor against gguf-py: CI keeps every tensor type
    # against gguf-py on small files and the published file's greedy output against
    # llama.cpp.
    "tests/python/test_gguf_tensor_types.py::test_gemma3_270m_q4_k_m_as_published_equals_gguf_py",
    # Two ranks: CI keeps the pipeline group (deepseek_v3, no speculation) for the session,
    # the restart and the disconnects, and tensor parallelism in the sharded-logits and
    # lost-rank tests; the tensor group with ngram speculation runs all three here.
    "tests/python/test_distributed.py::test_server_session_matches_one_rank[llama-tensor-ngram]",
    "tests/python/test_distributed.py::test_a_restart_reads_each_ranks_own_disk_tier[llama-tensor-ngram]",
    "tests/python/test_distributed.py::test_disconnects_leave_both_ranks_serving[llama-tensor-ngram]",
    # ... and the pipeline group's lost or hung rank and its restart from each rank's disk
    # tier (CI keeps its session, its disconnects and the misconfigurations).
    "tests/python/test_distributed.py::test_a_lost_or_hung_rank_stops_the_group",
    "tests/python/test_distributed.py::test_a_restart_reads_each_ranks_own_disk_tier",
    # A second model loading on the host thread while a resident one decodes: CI keeps the
    # hosted engines' own tests (tokens written from the engine's thread, no starvation,
    # a failed loop, a stop) and concurrent requests sharing one load over HTTP.
    "tests/python/test_engine_host.py::test_a_load_evaluates_on_the_host_thread_while_a_resident_model_decodes",
    # Claude Code's model names routed to their models: CI keeps the routing rules' unit
    # tests and the cold-load streams on every route.
    "tests/http/test_multi_model.py::test_claude_code_names_route_to_their_models",
    # Reported size = measured RSS: CI keeps both loads of Gemma and the embedded model's
    # default load.
    "tests/python/test_resident_size.py::test_reported_size_is_the_measured_resident_size[embedded-quantized]",
    "tests/python/test_resident_size.py::test_reported_size_is_the_measured_resident_size[gemma-auto]",
    # Many samples at a temperature: CI keeps each default's and sampler's own test
    # (tests/http/test_sampling_defaults.py, seeds, forced calls at temperature 0.8 through
    # OpenAI's `required` over five seeds).
    "tests/http/test_sampling_defaults.py::test_a_new_user_asking_for_the_capital_of_france_mostly_gets_paris",
    "tests/http/test_responses_api.py::test_forced_function_call_is_valid_five_times_at_temperature_0_8",
    "tests/http/test_anthropic_api.py::test_default_temperature_applies_only_when_unset",
    "tests/python/test_constrained_engine.py::test_sampled_json_validates_in_a_batch_with_free_rows",
    # Output formats over HTTP: CI keeps Anthropic's output format, text completions',
    # `json_object`, OpenAI's named and required calls, and the SDKs rebuilding streamed
    # tool calls (tests/http/test_tool_calls.py); every JSON schema's grammar is checked in
    # tests/python/test_tool_grammars.py.
    "tests/http/test_constrained_http.py::test_openai_json_schema_outputs_validate",
    "tests/http/test_constrained_http.py::test_streamed_forced_calls_rebuild_through_both_sdks",
    # Gemma 4's forced call keeping to an enum on the embedded model: CI keeps the enum
    # grammars of every format on scripted replies (test_argument_schemas_per_format.py).
    "tests/python/test_argument_schemas_per_format.py::test_gemma4_forced_call_keeps_to_the_enum",
    # Vision families over both APIs against mlx-vlm: CI keeps Qwen2.5-VL and Qwen3-VL (and
    # every family's directory load and image tokens in tests/python/test_vlm.py).
    "tests/http/test_vision_families_http.py::test_text_and_image_requests_in_both_apis_answer_as_mlx_vlm[qwen2_vl]",
    "tests/http/test_vision_families_http.py::test_text_and_image_requests_in_both_apis_answer_as_mlx_vlm[qwen3_vl_moe]",
    # Eight greedy streams at once: CI keeps prompts prefilled together, a request joining
    # mid-batch, per-request sampling in one batch and preemption, and batched greedy in
    # the speculative, 8-bit KV and MTP tests.
    "tests/python/test_batching.py::test_eight_concurrent_greedy_streams_match_each_run_alone",
    # The model drafting for itself: CI keeps a random draft model (all rejected, output
    # unchanged), the draft cache's rollback and the draft model directory's load.
    "tests/python/test_draft_model.py::test_the_model_drafting_for_itself_is_always_accepted",
    # `tool_choice: any` at temperature 0.8, ten seeds through the Anthropic SDK: CI keeps
    # OpenAI's `required` (the same grammar) over five seeds, and the Anthropic SDK's named
    # call, whole and streamed.
    "tests/http/test_constrained_http.py::test_anthropic_forced_calls_are_one_valid_tool_use",
    # A prefix hit at every split: CI keeps both sides of one block boundary (15, 16, 17),
    # the first token and the whole prompt; the second and third boundaries run here.
    "tests/python/test_prefix_cache.py::test_a_hit_at_any_split_gives_the_uncached_output[63]",
    "tests/python/test_prefix_cache.py::test_a_hit_at_any_split_gives_the_uncached_output[64]",
    "tests/python/test_prefix_cache.py::test_a_hit_at_any_split_gives_the_uncached_output[65]",
    "tests/python/test_prefix_cache.py::test_a_hit_at_any_split_gives_the_uncached_output[130]",
    # MTP: CI keeps the rejection rule's statistical test on exact tables
    # (tests/python/test_speculative_distribution.py), MTP with 8-bit KV, a prefix-cache
    # repeat, LoRA rows and the disk tier (test_mtp.py, test_mtp_combos.py), and with ngram
    # drafts a JSON schema and a thinking budget (test_speculative.py,
    # test_thinking_budgets.py); the engine-level sampled distribution, 4-bit KV, a JSON
    # schema, a forced tool call and a thinking budget with MTP drafts run here.
    "tests/python/test_mtp_sampled.py::test_sampled_mtp_tokens_follow_the_models_softmax",
    # Speculation on sliding-window and hybrid models: CI keeps ngram with rows of three
    # lengths on Gemma 3 and Qwen3-Next, 8-bit windows, the rollback of every family and
    # Qwen3-Next's MTP head; two turns and a repeat through the prefix cache run here.
    "tests/python/test_speculative.py::test_windows_and_recurrent_state_speculate_through_the_prefix_cache",
    "tests/python/test_mtp_combos.py::test_a_forced_tool_call_masks_mtp_drafts_and_decodes_as_plain",
    "tests/python/test_mtp_combos.py::test_mtp_with_4_bit_kv_decodes_as_plain_4_bit_kv",
    "tests/python/test_mtp_combos.py::test_a_json_schema_masks_mtp_drafts_and_decodes_as_plain",
    "tests/python/test_mtp_combos.py::test_a_thinking_budget_closes_at_the_same_token_with_mtp",
    # MTP from a GGUF's nextn block with one tensor missing: CI keeps a nextn norm (the
    # error naming it); an expert tensor and the router's bias of the MTP layer run here.
    "tests/python/test_gguf_nextn.py::test_a_gguf_missing_one_nextn_tensor_names_it[blk.2.ffn_up_exps.weight]",
    "tests/python/test_gguf_nextn.py::test_a_gguf_missing_one_nextn_tensor_names_it[blk.2.exp_probs_b.bias]",
    # Claude Code's captured sessions twice through /v1/messages: CI replays eight of the
    # eleven with the default `--reply-history loop`, and three (the default body, a tool
    # round, the recipe's last request) with `template`.
    "tests/http/test_two_pass_replay.py::test_each_session_twice[loop-continue_default]",
    "tests/http/test_two_pass_replay.py::test_each_session_twice[loop-toolong]",
    "tests/http/test_two_pass_replay.py::test_each_session_twice[loop-recipe_final]",
    *(
        f"tests/http/test_two_pass_replay.py::test_each_session_twice[template-{capture}]"
        for capture in (
            "authtoken",
            "bare",
            "compact_w18500",
            "continue_default",
            "reject_sysrole",
            "sys_terse_bash",
            "tool_thinking",
            "toolong",
        )
    ),
    # The rejection rule's first drafted position over 40,000 draws of one table: CI keeps
    # the stronger view of the same function, the chi-square test of the first two emitted
    # tokens with both drafters (tests/python/test_speculative_distribution.py).
    "tests/python/test_speculative.py::test_speculative_sampling_rule_keeps_the_target_distribution",
)
