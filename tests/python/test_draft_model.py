"""Draft-model speculation (engine/draft_model.py): a draft model inside the batched
engine gives the same greedy tokens as plain decoding whether its drafts are all right
(the embedded model drafting for itself) or all wrong (a tiny random llama with the same
tokenizer); its cache rolls back exactly; drafts that cannot roll back turn it off; a
draft with another vocabulary is refused at start."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.draft_model import DraftModel, DraftModelError, check_same_vocabulary
from compat_serve.engine.engine import Engine
from compat_serve.engine.speculation import SpeculationConfig
from compat_serve.engine.types import EngineRequest, SamplingParams
from tests.chat_prompts import chat_ids
from tests.extended import EXTENDED
from tests.greedy_ties import assert_same_or_near_tie
from tests.python.test_batching import greedy
from tests.python.test_speculative import COPY_PROMPTS, FREE_PROMPT, outputs, tokens
from tests.tiny_models import tiny_model, write_model_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel


def draft_engine(
    target: LoadedModel, draft: LoadedModel | None, *, cost_aware: bool = False
) -> Engine:
    """An engine drafting with `draft` (None: no speculation), by default on every step
    a draft exists (drafting with the target itself never pays: the cost policy would
    soon stop, and these tests are about the drafting path)."""
    spec = SpeculationConfig("draft", num_tokens=4, draft=draft, cost_aware=cost_aware)
    spec = spec if draft else SpeculationConfig()
    engine = Engine(
        target,
        EngineConfig(prefill_chunk=128, max_num_seqs=8, prefix_cache=False, speculation=spec),
    )
    engine.start()
    return engine


def mixed_requests(loaded: LoadedModel, tag: str, max_tokens: int = 24) -> list[EngineRequest]:
    return [
        EngineRequest(f"{tag}{i}", chat_ids(loaded, text), greedy(max_tokens))
        for i, text in enumerate([*COPY_PROMPTS, FREE_PROMPT])
    ]


# The random draft decodes 12 tokens a row (every step still drafts and rejects); the
# model drafting for itself (extended run) 24, which plain decoding then runs to.
RANDOM_DRAFT_TOKENS = 12
PLAIN_TOKENS = 24 if EXTENDED else RANDOM_DRAFT_TOKENS


@pytest.fixture(scope="module")
def plain_outputs(embedded_model: LoadedModel) -> list[list[int]]:
    engine = draft_engine(embedded_model, None)
    try:
        reqs = mixed_requests(embedded_model, "p", max_tokens=PLAIN_TOKENS)
        return [tokens(e) for e in outputs(engine, reqs)]
    finally:
        engine.shutdown()


def test_the_model_drafting_for_itself_is_always_accepted(
    embedded_model: LoadedModel, plain_outputs: list[list[int]]
) -> None:
    engine = draft_engine(embedded_model, embedded_model)
    try:
        reqs = mixed_requests(embedded_model, "self")
        got = [tokens(e) for e in outputs(engine, reqs)]
        greedy_status = dict(engine.speculation_status())
        # Sampled rows draw drafts from q = p: the rule keeps each with min(1, p/q) = 1.
        sampled = [
            EngineRequest(
                f"ss{i}",
                chat_ids(embedded_model, FREE_PROMPT),
                SamplingParams(max_tokens=16, temperature=1.0, seed=i),
            )
            for i in range(2)
        ]
        outputs(engine, sampled)
        status = engine.speculation_status()
    finally:
        engine.shutdown()
    for request, want, have in zip(reqs, plain_outputs, got, strict=True):
        assert_same_or_near_tie(embedded_model, request.prompt_ids, want, have)
    assert greedy_status["mode"] == "draft"
    assert int(greedy_status["draft_tokens"]) > 30, greedy_status  # type: ignore[call-overload]
    assert greedy_status["acceptance_rate"] == 1.0, greedy_status
    drafted = int(status["draft_tokens"]) - int(greedy_status["draft_tokens"])  # type: ignore[call-overload]
    accepted = int(status["accepted_tokens"]) - int(greedy_status["accepted_tokens"])  # type: ignore[call-overload]
    assert drafted > 10 and accepted / drafted > 0.95, (drafted, accepted, status)


def test_a_random_draft_model_is_rejected_and_changes_nothing(
    embedded_model: LoadedModel, plain_outputs: list[list[int]]
) -> None:
    draft = tiny_model("llama", embedded_model)
    engine = draft_engine(embedded_model, draft)
    try:
        reqs = mixed_requests(embedded_model, "rnd", max_tokens=RANDOM_DRAFT_TOKENS)
        got = [tokens(e) for e in outputs(engine, reqs)]
        status = engine.speculation_status()
    finally:
        engine.shutdown()
    for request, plain, have in zip(reqs, plain_outputs, got, strict=True):
        # Greedy: plain decoding's first tokens (all of them in CI) are this run's.
        want = plain[:RANDOM_DRAFT_TOKENS]
        assert_same_or_near_tie(embedded_model, request.prompt_ids, want, have)
    assert int(status["draft_tokens"]) > 0, status  # type: ignore[call-overload]
    assert status["acceptance_rate"] is not None and float(status["acceptance_rate"]) < 0.2  # type: ignore[arg-type]


def test_draft_cache_rolls_back_to_exactly_the_accepted_tokens(
    embedded_model: LoadedModel,
) -> None:
    """Three rows draft 4 tokens; the target accepts 0, 2 and 4 of them. The next
    proposal (after each row's accepted drafts and a new token) equals the proposal of a
    fresh draft model that never saw the rejected ones."""
    used = DraftModel(embedded_model)
    vocab = embedded_model.tokenizer.vocab_size
    keys = ["a", "b", "c"]
    rows = [list(chat_ids(embedded_model, t)) for t in ("Hi", "Count to five please", "Go")]
    first = used.propose(keys, rows, [4, 4, 4], [None] * 3, vocab)
    accepted = {"a": 0, "b": 2, "c": 4}
    used.settle(accepted)
    nxt = [
        row + first.drafts[i][: accepted[k]] + [100 + i]
        for i, (k, row) in enumerate(zip(keys, rows, strict=True))
    ]
    again = used.propose(keys, nxt, [3, 3, 3], [None] * 3, vocab)
    fresh = DraftModel(embedded_model).propose(keys, nxt, [3, 3, 3], [None] * 3, vocab)
    # Greedy drafts of a rolled-back cache vs a fresh one: equal up to a near tie.
    for row, want, have in zip(nxt, fresh.drafts, again.drafts, strict=True):
        assert_same_or_near_tie(embedded_model, row, want, have)
    # A row that left and a new one: the batch follows the rows asked about.
    later = used.propose(
        ["c", "d"], [nxt[2] + again.drafts[2][:1], rows[0]], [2, 2], [None] * 2, vocab
    )
    alone = DraftModel(embedded_model).propose(["d"], [rows[0]], [2], [None], vocab)
    assert_same_or_near_tie(embedded_model, rows[0], alone.drafts[0], later.drafts[1])


@pytest.mark.parametrize("model_type", ["gemma3_text", "lfm2"])
def test_draft_models_whose_cache_cannot_roll_back_turn_speculation_off(
    model_type: str, embedded_model: LoadedModel, caplog: pytest.LogCaptureFixture
) -> None:
    """Rotating (sliding-window) and recurrent caches cannot drop rejected drafts."""
    with pytest.raises(DraftModelError, match="cannot roll back"):
        DraftModel(tiny_model(model_type, embedded_model))
    engine = draft_engine(embedded_model, tiny_model(model_type, embedded_model))
    try:
        status = engine.speculation_status()
        req = EngineRequest("h", chat_ids(embedded_model, FREE_PROMPT), greedy(3))
        assert len(tokens(outputs(engine, [req])[0])) == 3
    finally:
        engine.shutdown()
    assert status["mode"] == "off" and "cannot roll back" in str(status["disabled_reason"])
    assert "speculative decoding is off" in caplog.text


class _Vocab:
    def __init__(self, vocab: dict[str, int]) -> None:
        self._vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return self._vocab


def test_a_draft_with_another_vocabulary_is_refused() -> None:
    same: Any = _Vocab({"a": 0, "b": 1})
    check_same_vocabulary(same, _Vocab({"a": 0, "b": 1}))  # type: ignore[arg-type]
    with pytest.raises(DraftModelError, match=r"1 of 2 tokens differ .*'b': id 1 .* 2"):
        check_same_vocabulary(same, _Vocab({"a": 0, "b": 2}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="needs --draft-model"):
        SpeculationConfig("draft").validate()
    with pytest.raises(ValueError, match="only used with --speculative draft"):
        SpeculationConfig("ngram", draft_model="/models/small").validate()


def test_serve_options_load_the_draft_model_dir_and_refuse_another_vocabulary(
    embedded_model: LoadedModel, tmp_path: Path
) -> None:
    """`--speculative draft --draft-model DIR` as the CLI passes it: a directory with the
    target's tokenizer drafts; one whose tokenizer numbers tokens differently is refused
    before serving, naming a differing token."""
    from compat_serve.bootstrap import ServeOptions, build_state

    good = tmp_path / "draft"
    write_model_dir(good, "llama", embedded_model)
    options = ServeOptions(speculative="draft", draft_model=str(good), prefix_cache=False)
    state = build_state(options, embedded_model)
    try:
        assert state.engine.speculation_status()["mode"] == "draft"
    finally:
        state.engine.shutdown()
    bad = tmp_path / "other-vocab"
    shutil.copytree(good, bad)
    tokenizer = json.loads((bad / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first, second = (t for t, i in vocab.items() if i in (1000, 1001))
    vocab[first], vocab[second] = vocab[second], vocab[first]
    (bad / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(DraftModelError, match=r"2 of \d+ tokens differ"):
        build_state(dataclasses.replace(options, draft_model=str(bad)), embedded_model)
