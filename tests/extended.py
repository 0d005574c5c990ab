"""The extended run: slower second views of what `make test` already checks, kept out of
CI's time budget and run by `make test-extended` (COMPAT_SERVE_TEST_EXTENDED=1).

A test marked `extended` is deselected unless the variable is set (tests/conftest.py); a
test that samples a set in CI (the chat templates of eight tool formats, say) takes the
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
    # Greedy continuations equal llama.cpp's on the published Gemma file: CI keeps the
    # users' load (`--dtype quantized`); the float32 load is compared past the sliding
    # window in CI (test_past_the_sliding_window_alone_batched_and_cached[auto]).
    "tests/llamacpp/test_gemma_vs_llamacpp.py::test_greedy_continuations_equal_llamacpp[auto]",
    # Two ranks: CI keeps the pipeline group (deepseek_v3, no speculation) for the session,
    # the restart and the disconnects, and tensor parallelism in the sharded-logits and
    # lost-rank tests; the tensor group with ngram speculation runs all three here.
    "tests/python/test_distributed.py::test_server_session_matches_one_rank[llama-tensor-ngram]",
    "tests/python/test_distributed.py::test_a_restart_reads_each_ranks_own_disk_tier[llama-tensor-ngram]",
    "tests/python/test_distributed.py::test_disconnects_leave_both_ranks_serving[llama-tensor-ngram]",
    # Reported size = measured RSS: CI keeps both loads of Gemma and the embedded model's
    # default load.
    "tests/python/test_resident_size.py::test_reported_size_is_the_measured_resident_size[embedded-quantized]",
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
    # Claude Code's captured sessions twice through /v1/messages: CI replays every session
    # with the default `--reply-history loop`, and three (the default body, a tool round,
    # the recipe's last request) with `template`.
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
)
