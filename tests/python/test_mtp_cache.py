"""The MTP head's own KV cache (engine/mtp_cache.py, #45): fed with the main model's hidden
states after every op, it must hold exactly the row's verified positions, and the head's
step on it must be its layer run over the row's whole sequence of (hidden[t],
token[t + 1]) pairs with a causal mask, as the reference implementations run it.

On a tiny random llama (tests/tiny_models.py) and a random llama head: fast, and what is
checked does not depend on the head drafting well.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import mlx.core as mx
from mlx_lm.models import llama

from compat_serve.engine.applier import StepApplier
from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.mtp_cache import MTPDrafter
from compat_serve.engine.mtp_head import HiddenCapture, MTPHead, new_llama_head
from compat_serve.engine.runner import ModelRunner
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.step_plan import Decode, Restore
from compat_serve.engine.types import EngineRequest
from tests.chat_prompts import chat_ids
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_batching import greedy
from tests.python.test_speculative import COPY_PROMPTS, FREE_PROMPT, outputs, tokens

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel

# The cached path and the reference compute the same float32 function in other orders
# (chunks, batch rows, left padding): each reduction of n terms is within n u of exact
# (u = 2^-24), the longest here has n = 128 (the MLP), and the main model's two layers,
# its norm and the head's layer chain about 16 of them; relative to the logits' scale.
BOUND = 2.0**-24 * 128 * 16


def _reference_logits(head: MTPHead, model: Any, hidden: mx.array, toks: list[int]) -> mx.array:
    """The head's layer once over all pairs `(hidden [1, T, H], toks [T])`, causal: the
    last position's logits and un-normed output (what DeepSeek-V3's step chains on)."""
    layer = head.layer
    e = layer.enorm(model.model.embed_tokens(mx.array([toks], dtype=mx.uint32)))
    x = layer.eh_proj(mx.concatenate([e, layer.hnorm(hidden)], axis=-1))
    y = llama.TransformerBlock.__call__(layer, x, mask="causal")
    return model.lm_head(layer.shared_head.norm(y[:, -1]))[0], y[:, -1]


def _close(have: mx.array, want: mx.array) -> None:
    scale = float(mx.abs(want).max())
    assert float(mx.abs(have - want).max()) <= BOUND * (1 + scale)


@dataclasses.dataclass
class Row:
    fed: list[int]  # every token the main model computed for the row, in order
    cached: int = 0  # of them, restored from the prefix cache (no hidden states)


def test_the_cached_head_steps_as_its_layer_over_the_whole_sequence_and_keeps_only_verified(
    tiny_llama_model: LoadedModel,
) -> None:
    """Four rows reach the batch four ways (two prefill chunks, the last one's two
    forwards; a prefix-cache restore then a chunk; a batched prefill of two prompts of
    different lengths), then a plain decode step and a verify whose rows keep 3, 1, 1 and
    2 of their positions. The head's cache then holds each row's computed positions less
    one (the last hidden state waits for its next token), none of the rejected ones; two
    chained steps on it give the reference's logits, and drafting leaves it as it was."""
    model = tiny_llama_model.model
    mx.random.seed(45)
    head = MTPHead(new_llama_head(model), model)
    applier = StepApplier(ModelRunner(tiny_llama_model))
    drafter = MTPDrafter(head, HiddenCapture(model))
    applier.observers.append(drafter.observe)
    prompt = [(7 * i + 3) % 900 + 10 for i in range(40)]
    rows = {"a": Row(prompt[:9]), "b": Row(prompt[3:10], 4), "c": Row(prompt[10:16])}
    rows["d"] = Row(prompt[20:23])

    applier.new_cache("a")
    applier.prefill("a", 0, rows["a"].fed[:5])
    applier.last_logits("a", 5, rows["a"].fed[5:])
    applier.new_cache("b")  # a prefix-cache hit: 4 positions filled without the applier
    applier.runner.prefill(applier.own_cache("b") or [], rows["b"].fed[:4])
    applier.restored(Restore("b", 4, (), 0))
    applier.last_logits("b", 4, rows["b"].fed[4:])
    applier.new_cache("c")
    applier.new_cache("d")
    _, commit = applier.prefill_together(["c", "d"], [rows["c"].fed, rows["d"].fed])
    commit()
    ids = ["a", "b", "c", "d"]
    applier.join(ids)
    step = [31, 32, 33, 34]
    applier.decode(ids, step)
    verify = [[41, 42, 43], [44], [45, 46], [47, 48, 49, 50]]
    kept = [3, 1, 1, 2]
    mx.eval(applier.verify(ids, verify))
    applier.rollback([4 - k for k in kept])
    for rid, token, fed, k in zip(ids, step, verify, kept, strict=True):
        rows[rid].fed += [token, *fed[:k]]

    assert drafter.broken is None
    assert drafter.batch.ids == ids and not drafter.own
    head_cache, main_cache = drafter.batch.cache[0], applier.batch.cache[0]
    want = [len(rows[rid].fed) - rows[rid].cached - 1 for rid in ids]
    assert head_cache.offset.tolist() == want
    assert main_cache.offset.tolist() == [len(rows[rid].fed) for rid in ids]

    following, second = [51, 52, 53, 54], [61, 62, 63, 64]
    pending = mx.stack([drafter.rows[rid].pending for rid in ids])  # type: ignore[misc]
    logits, chained = head.step(pending, mx.array(following, dtype=mx.uint32), head_cache)
    logits_2, _ = head.step(chained, mx.array(second, dtype=mx.uint32), head_cache)
    head_cache.trim(2)
    for i, rid in enumerate(ids):
        row = rows[rid]
        hidden = model.model(mx.array([row.fed], dtype=mx.uint32))[:, row.cached :]
        pairs = [*row.fed[row.cached + 1 :], following[i]]
        want_logits, want_chained = _reference_logits(head, model, hidden, pairs)
        _close(logits[i], want_logits)
        with_draft = mx.concatenate([hidden, want_chained[:, None]], axis=1)
        want_2, _ = _reference_logits(head, model, with_draft, [*pairs, second[i]])
        # The chained input differs by step 1's rounding too: twice the bound.
        _close(logits_2[i] / 2, want_2 / 2)

    drafts, _ = drafter.propose(ids, following, [3, 0, 2, 1], [None] * 4, model.args.vocab_size)
    assert [len(d) for d in drafts] == [3, 0, 2, 1]
    assert head_cache.offset.tolist() == want
    assert drafter.ready("a", len(rows["a"].fed)) and not drafter.ready("a", len(rows["a"].fed) + 1)
    applier.drop(["b"])
    assert drafter.batch.ids == ["a", "c", "d"] and "b" not in drafter.rows
    drafter.observe(Decode(("a", "d"), (1, 2), ()))  # rows the head does not have
    assert drafter.broken is not None and "not the batch's" in drafter.broken
    assert not drafter.ready("a", len(rows["a"].fed)) and not drafter.rows


def test_greedy_mtp_equals_plain_decoding_for_rows_of_different_lengths_and_a_cache_hit(
    tiny_llama_model: LoadedModel,
) -> None:
    """A prompt alone (filling the prefix cache), then a batch of that prompt again (a
    prefix-cache hit), a short and a long one: greedy output with the head drafting every
    step equals plain decoding, the head's cache follows the model to the end, and rows
    leaving free it."""
    loaded = tiny_llama_model
    first = EngineRequest("first", chat_ids(loaded, COPY_PROMPTS[0]), greedy(12))
    batch = [
        dataclasses.replace(first, request_id="again"),
        EngineRequest("short", chat_ids(loaded, "Hi.")[:12], greedy(12)),
        EngineRequest("long", chat_ids(loaded, FREE_PROMPT), greedy(12)),
    ]
    got: dict[str, list[list[int]]] = {}
    mx.random.seed(7)
    head = MTPHead(new_llama_head(loaded.model), loaded.model)
    for spec in (SpeculationConfig(), SpeculationConfig("mtp", 3, cost_aware=False, mtp=head)):
        engine = Engine(loaded, EngineConfig(prefill_chunk=32, max_num_seqs=4, speculation=spec))
        engine.start()
        try:
            alone = outputs(engine, [first])
            together = outputs(engine, batch)
            status = engine.speculation_status()
            drafter = engine._executor.spec._mtp
        finally:
            engine.shutdown()
        got[spec.mode] = [tokens(e) for e in [*alone, *together]]
        assert together[0][-1].usage is not None and together[0][-1].usage.cached_tokens > 0
    assert status["mode"] == "mtp", status
    assert int(status["draft_tokens"]) > 20, status  # type: ignore[call-overload]
    assert drafter is not None and drafter.broken is None
    assert not drafter.rows and not drafter.own and not drafter.batch.ids
    for request, want, have in zip([first, *batch], got["off"], got["mtp"], strict=True):
        assert_same_or_near_tie(loaded, request.prompt_ids, want, have)
