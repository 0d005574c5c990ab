"""Which existing tests also run in the users'-path lane (`make test-users-path`).

That lane sets `COMPAT_SERVE_TEST_DTYPE=quantized`: the session's `embedded_model` keeps
the GGUF's Q4_1/Q8_0 weights quantized and `tiny_llama_model` is quantized with
`mlx.nn.quantize`, both running stock mlx-lm modules and MLX's quantized kernels, as on
Metal and CUDA. MLX's CPU quantized matmul is ~15x slower than dense float32, so the lane
is a small subset, picked per area (the whole pass must stay within ~2.5 minutes of CI):
tests on the tiny model where they exist, short outputs on the embedded one.

The list lives here, not as decorators in each file, so the lane's cost is reviewed in one
place; `tests/conftest.py` marks these tests `users_path` (`pytest -m users_path` selects
them) and adds the lane's own acceptance tests (marked in their module).
"""

from __future__ import annotations

# Batching, quantized KV, the disk tier and the repeat-from-cache checks on the embedded
# model are tests/python/test_users_path.py's (short prompts written for this lane).
USERS_PATH_TESTS: tuple[str, ...] = (
    # Engine: the prompt-only request and a failing request next to a good one.
    "tests/python/test_engine.py::test_max_tokens_zero_processes_prompt_only",
    "tests/python/test_engine.py::test_engine_survives_a_failing_request",
    # Speculation (draft, verify, rollback) and a prefix hit, replayed on the tiny model.
    "tests/python/test_step_plan_replay.py::test_a_replay_with_speculation_reproduces_verify_and_rollback",
    "tests/python/test_step_plan_replay.py::test_a_prefix_cache_hit_replays_from_the_followers_own_blocks",
    # Constrained decoding.
    "tests/python/test_constrained_engine.py::test_a_grammar_that_cannot_finish_in_max_tokens_stops_for_length",
    "tests/python/test_constrained_engine.py::test_a_bad_grammar_is_refused_at_submit_and_the_engine_keeps_serving",
    # HTTP, both APIs: a replayed agent session's cache reads, and count_tokens = usage.
    "tests/http/test_prefix_cache_replay.py::test_recipe_final_reads_everything_it_shares_from_the_cache",
    "tests/http/test_prefix_cache_replay.py::test_count_tokens_matches_usage",
    "tests/http/test_anthropic_api.py::test_max_tokens_zero_and_prefill",
    "tests/http/test_dashboard.py::test_snapshot_describes_the_model_memory_and_window",
    # Vision: a tiny Qwen2.5-VL (float32: mlx-vlm's own modules, never the CPU fast paths).
    "tests/http/test_vision_http.py::test_anthropic_sdk_image_answer_equals_mlx_vlm",
)


def lane_files() -> list[str]:
    """The test files the lane collects: those of `USERS_PATH_TESTS` and the lane's own
    acceptance tests (collecting the whole suite would cost a minute of imports)."""
    own = ["tests/python/test_users_path.py"]
    return sorted({test.split("::")[0] for test in USERS_PATH_TESTS} | set(own))


if __name__ == "__main__":  # the Makefile's lane asks for its file list
    print(" ".join(lane_files()))
