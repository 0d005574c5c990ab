"""Token-exact prefix reuse: a request reads every token it shares with anything cached —
whole blocks, then the longest common prefix inside a child block (one a reply filled)
or a tail. Greedy output equals the uncached run; logits stay within 1e-3."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.engine import Engine
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_prefix_cache import BLOCK, check_usage, run

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

TEXT = (
    "<|im_start|>system\nYou answer in short sentences.<|im_end|>\n<|im_start|>user\n"
    "List three colours of the sea at dawn and say why.<|im_end|>\n<|im_start|>assistant\n"
)


def _prompt(model: LoadedModel, length: int, tag: str) -> tuple[int, ...]:
    ids = tuple(model.tokenizer.encode(f"[{tag}] " + TEXT * 4))
    assert len(ids) >= length
    return ids[:length]


@pytest.mark.parametrize(("length", "max_tokens"), [(33, 8), (39, 12), (47, 3), (48, 8), (52, 1)])
def test_an_exact_repeat_reads_all_but_the_last_token(
    cached: Engine, embedded_model: LoadedModel, length: int, max_tokens: int
) -> None:
    # The prompt's partial last block ends up inside a block its reply filled (long
    # replies) or in a tail (short ones); either way the repeat reads it.
    prompt = _prompt(embedded_model, length, "repeat")
    salt = f"repeat-{length}".encode()  # each case starts from an empty cache
    first_tokens, first = run(cached, prompt, max_tokens=max_tokens, salt=salt)
    assert first.cached_tokens == 0
    tokens, again = run(cached, prompt, max_tokens=max_tokens, salt=salt)
    assert again.cached_tokens == length - 1
    assert again.cache_creation_tokens == 0
    assert_same_or_near_tie(embedded_model, prompt, first_tokens, tokens)
    check_usage(again)


def test_a_turn_diverging_inside_a_reply_block_reads_up_to_the_divergence(
    tiny_cached: Engine, tiny_uncached: Engine, tiny_llama_model: LoadedModel
) -> None:
    cached, uncached, model = tiny_cached, tiny_uncached, tiny_llama_model
    prompt = _prompt(model, 37, "diverge")
    reply, first = run(cached, prompt, max_tokens=14, salt=b"diverge")
    assert first.cached_tokens == 0
    assert len(reply) == 14
    other = model.tokenizer.encode(" Blue, grey and gold.")
    # Divergence points inside the block the reply filled (37..47) and after it.
    for d in (0, 3, 10, 11, 12):
        echoed = list(reply[:d]) + [t for t in other if t != reply[d]][:1]
        follow_up = (*prompt, *echoed, *other)
        tokens, usage = run(cached, follow_up, max_tokens=3, salt=b"diverge")
        assert usage.cached_tokens == len(prompt) + d, d
        expected, _ = run(uncached, follow_up, max_tokens=3)
        assert_same_or_near_tie(model, follow_up, expected, tokens)
        check_usage(usage)


def test_logits_after_a_partial_child_block_match_a_full_forward(
    cached: Engine, embedded_model: LoadedModel
) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prefix = cached.prefix
    assert prefix is not None
    salt = b"partial-logits"
    full = _prompt(embedded_model, 64, "logits")
    run(cached, full, max_tokens=0, salt=salt)  # blocks 0..3 cached
    model: Any = embedded_model.model
    for shared in (17, 25, 31, 40):
        # Shares `shared` tokens, then diverges inside block `shared // BLOCK`.
        prompt = (*full[:shared], 11, 12, 13)
        whole = shared // BLOCK * BLOCK
        admission = prefix.cache.admit("probe", list(prompt[: whole + 1]), salt)
        try:
            assert admission.cached_tokens == whole
            parent = prefix.cache.block_hashes(list(prompt[:whole]), salt)[-1]
            hit = prefix._partial(parent, list(prompt[whole:]), len(prompt) - 1 - whole)
            assert hit is not None and hit.length == shared - whole
            cache = make_prompt_cache(model)
            prefix.store.assemble(list(admission.block_ids), cache, (hit.kv, hit.length))
            warm = model(mx.array([prompt[shared:]]), cache=cache)[0, -1]
            cold = model(mx.array([prompt]), cache=make_prompt_cache(model))[0, -1]
            assert mx.abs(warm - cold).max().item() < 1e-3
        finally:
            prefix.cache.release("probe")
