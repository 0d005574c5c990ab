"""Vision-language models through the same engine (issue #18, #25): tiny random models of
mlx-vlm's architectures (the Qwen-VL family with M-RoPE: Qwen2-VL, Qwen2.5-VL, Qwen3-VL
and its MoE with DeepStack; Idefics3 = SmolVLM's), written to a directory with a real
tokenizer and loaded offline through our loader, against mlx-vlm's own generation on the
same files. That the text-only install never imports mlx-vlm is checked in a fresh
process by tests/python/test_resident_size.py."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

from compat_serve.engine.config import EngineConfig
from compat_serve.engine.engine import Engine
from compat_serve.engine.types import EngineRequest, FinishReason, SamplingParams, Usage
from compat_serve.models.types import LoadedModel
from compat_serve.models.vision_input import VisionInput
from tests.greedy_ties import assert_same_as_engine_or_near_tie
from tests.tiny_vlm import QWEN_VL_TYPES, tiny_vlm

pytest.importorskip("mlx_vlm", reason="compat-serve[vision] is installed by make setup")

BLOCK = 8
CHUNK = 24  # chunks end inside the 16-token images below
TOKENS = 8


def image(seed: int, size: tuple[int, int] = (112, 112)) -> Any:
    from PIL import Image

    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@dataclass
class Vlm:
    loaded: LoadedModel
    vlm: Any  # mlx-vlm's model, loaded by mlx-vlm from the same directory
    processor: Any
    cached: Engine
    uncached: Engine

    def prompt_text(self, text: str, images: int) -> str:
        from mlx_vlm.prompt_utils import apply_chat_template

        out: str = apply_chat_template(self.processor, self.vlm.config, text, num_images=images)
        return out

    def request(self, text: str, *images: Any) -> tuple[tuple[int, ...], VisionInput | None]:
        ids = self.loaded.tokenizer.encode(self.prompt_text(text, len(images)))
        if not images:
            return tuple(ids), None
        processor = self.loaded.extra["vision"]
        full, vision = processor.expand(ids, [processor.prepare(i) for i in images])
        return tuple(full), vision

    def reference(self, text: str, *images: Any) -> Any:
        """mlx-vlm's own greedy generation for the same prompt and images."""
        from mlx_vlm import generate

        return generate(
            self.vlm,
            self.processor,
            self.prompt_text(text, len(images)),
            image=list(images) or None,
            max_tokens=TOKENS,
            temperature=0.0,
        )


# The Qwen-VL family, Idefics3 and SmolVLM's default: images split into tiles (2x2 + the
# global one here). Qwen3-VL-MoE differs from Qwen3-VL only in its language layers: it
# is served in tests/http/test_vision_families_http.py, not repeated here.
ARCHITECTURES = sorted([*QWEN_VL_TYPES, "idefics3", "idefics3-tiled"])
ARCHITECTURES.remove("qwen3_vl_moe")


@pytest.fixture(scope="module", params=ARCHITECTURES)
def vlm(request: pytest.FixtureRequest, embedded_model: LoadedModel) -> Iterator[Vlm]:
    tiny = tiny_vlm(request.param, embedded_model)
    loaded, model, processor = tiny.loaded, tiny.vlm, tiny.processor
    config = {"prefill_chunk": CHUNK, "block_size": BLOCK}
    cached = Engine(loaded, EngineConfig(**config))  # type: ignore[arg-type]
    uncached = Engine(loaded, EngineConfig(prefix_cache=False, **config))  # type: ignore[arg-type]
    cached.start()
    uncached.start()
    yield Vlm(loaded, model, processor, cached, uncached)
    cached.shutdown()
    uncached.shutdown()


_ids = iter(range(10**9))


def run(
    engine: Engine, prompt: tuple[int, ...], vision: VisionInput | None = None
) -> tuple[list[int], Usage]:
    async def go() -> tuple[list[int], Usage]:
        sampling = SamplingParams(max_tokens=TOKENS, temperature=0, stop_at_eos=False)
        request = EngineRequest(f"v{next(_ids)}", prompt, sampling, vision=vision)
        events = [e async for e in engine.submit(request)]
        assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
        assert events[-1].usage is not None
        return [t for e in events for t in e.token_ids], events[-1].usage

    return asyncio.run(go())


def assert_same_or_near_tie(
    vlm: Vlm,
    prompt: tuple[int, ...],
    vision: VisionInput | None,
    reference: list[int],
    tokens: list[int],
) -> None:
    """Tie-aware greedy equality (tests/greedy_ties.py). The reference's margin is read
    from the uncached engine teacher-forced on the reference's tokens, with the images:
    where the reference is mlx-vlm, the same model's logits up to float order."""
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0, stop_at_eos=False)
    request = EngineRequest(f"v{next(_ids)}", prompt, sampling, vision=vision)
    assert_same_as_engine_or_near_tie(vlm.uncached, request, reference, tokens)


def test_the_directory_loads_as_a_vision_language_model(vlm: Vlm) -> None:
    from mlx.utils import tree_flatten

    from compat_serve.models.vlm import VisionLanguageModel

    assert isinstance(vlm.loaded.model, VisionLanguageModel)
    assert vlm.loaded.model_type == vlm.vlm.config.model_type
    # The vision weights are loaded (not dropped as by a text-only load), as mlx-vlm has them.
    ours = dict(tree_flatten(vlm.loaded.model.vlm.parameters()))
    theirs = dict(tree_flatten(vlm.vlm.parameters()))
    vision = [k for k in theirs if k.startswith(("vision", "connector"))]
    assert vision and all(k in ours for k in vision)
    assert all(np.allclose(np.array(ours[k]), np.array(theirs[k])) for k in vision)


def test_text_only_greedy_output_equals_mlx_vlm(vlm: Vlm) -> None:
    text = "Name three colours of the sea."
    prompt, vision = vlm.request(text)
    assert vision is None
    ref = vlm.reference(text)
    assert len(set(ref.token_ids)) > 1  # the model's output depends on its input
    tokens, usage = run(vlm.uncached, prompt)
    assert usage.prompt_tokens == ref.prompt_tokens
    assert_same_or_near_tie(vlm, prompt, None, list(ref.token_ids), tokens)


def test_image_answer_and_prompt_count_equal_mlx_vlm(vlm: Vlm) -> None:
    for seed, size in ((1, (112, 112)), (2, (84, 56))):
        picture = image(seed, size)
        prompt, vision = vlm.request("Describe this picture.", picture)
        assert vision is not None
        ref = vlm.reference("Describe this picture.", picture)
        tokens, usage = run(vlm.uncached, prompt, vision)
        assert usage.prompt_tokens == ref.prompt_tokens == len(prompt)
        assert_same_or_near_tie(vlm, prompt, vision, list(ref.token_ids), tokens)
    if getattr(vlm.loaded.extra["vision"].image_processor, "do_image_splitting", False):
        # 112x112 in 56 px tiles: 2x2 tiles and the global one, a span each.
        _, tiled = vlm.request("x", image(1))
        assert tiled is not None and [s.length for s in tiled.spans] == [4] * 5
    if vlm.loaded.model_type in QWEN_VL_TYPES:
        # A 112x112 image is 4x4 merged tokens on 4 M-RoPE positions per axis: later
        # positions are shifted back by 12, per request.
        _, square = vlm.request("x", image(1))
        assert square is not None and square.rope_delta == -12
        # Qwen3-VL's DeepStack level rides with the features (the answers above would
        # differ from mlx-vlm's without it).
        span = square.spans[0]
        levels = vlm.loaded.model.encode_image(span.pixel_values, span.grid).shape[1]
        assert levels == (2 if vlm.loaded.model_type.startswith("qwen3_vl") else 1)


def test_different_images_give_different_answers(vlm: Vlm) -> None:
    a = run(vlm.uncached, *vlm.request("Describe this picture.", image(3)))[0]
    b = run(vlm.uncached, *vlm.request("Describe this picture.", image(4)))[0]
    assert a != b


def test_a_batch_mixing_image_and_text_rows_equals_each_row_alone(
    vlm: Vlm, monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = vlm.uncached._runner
    real = runner.decode_logits
    steps: list[tuple[int, Any]] = []  # rows and M-RoPE deltas of each decode step

    def spy(cache: Any, tokens: Any, *deltas: Any) -> Any:
        steps.append((len(tokens), deltas[0] if deltas else None))
        return real(cache, tokens, *deltas)

    monkeypatch.setattr(runner, "decode_logits", spy)
    sampling = SamplingParams(max_tokens=TOKENS, temperature=0, stop_at_eos=False)
    rows = [
        vlm.request("Describe this picture.", image(5)),
        vlm.request("What is the capital of France?"),
        vlm.request("And this one, in one word?", image(6, (84, 56))),
    ]
    requests = [
        EngineRequest(f"mix{i}", prompt, sampling, vision=vision)
        for i, (prompt, vision) in enumerate(rows)
    ]
    alone, together = run_alone_then_together_vision(vlm.uncached, requests)
    for (prompt, vision), a, t in zip(rows, alone, together, strict=True):
        assert_same_or_near_tie(vlm, prompt, vision, a, t)
    assert max(rows for rows, _ in steps) == len(requests), steps
    if vlm.loaded.model.mrope:  # image rows decode with their own position deltas
        assert any(d is not None and 0 in d and min(d) < 0 for _, d in steps), steps


def run_alone_then_together_vision(
    engine: Engine, requests: list[EngineRequest]
) -> tuple[list[list[int]], list[list[int]]]:
    """Each request alone, then all at once (test_batching's helper, keeping images)."""
    import dataclasses

    async def both() -> tuple[list[list[int]], list[list[int]]]:
        async def tokens(request: EngineRequest) -> list[int]:
            events = [e async for e in engine.submit(request)]
            assert events[-1].finish_reason is not FinishReason.ERROR, events[-1].error
            return [t for e in events for t in e.token_ids]

        first = [await tokens(r) for r in requests]
        renamed = [dataclasses.replace(r, request_id=f"{r.request_id}-b") for r in requests]
        second = await asyncio.gather(*(tokens(r) for r in renamed))
        return first, list(second)

    return asyncio.run(both())


def test_the_same_image_resent_reads_past_it_a_different_one_does_not(vlm: Vlm) -> None:
    text = "What is in this picture?"
    prompt, vision = vlm.request(text, image(7))
    assert vision is not None
    span = vision.spans[0]
    first, usage1 = run(vlm.cached, prompt, vision)
    assert usage1.cached_tokens == 0
    again, usage2 = run(vlm.cached, prompt, vision)
    assert_same_or_near_tie(vlm, prompt, vision, first, again)
    assert usage2.cached_tokens > span.start + span.length  # read past the image
    other_prompt, other = vlm.request(text, image(8))
    assert other_prompt == prompt  # same ids: only the pixels differ
    answer, usage3 = run(vlm.cached, other_prompt, other)
    # Only the blocks before the image are shared.
    assert usage3.cached_tokens <= span.start
    reference = run(vlm.uncached, other_prompt, other)[0]
    assert_same_or_near_tie(vlm, other_prompt, other, reference, answer)


def test_cached_and_uncached_prefill_logits_agree_with_an_image(vlm: Vlm) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    prompt, vision = vlm.request("Look closely. What colour dominates?", image(9))
    assert vision is not None
    run(vlm.cached, prompt, vision)
    prefix = vlm.cached.prefix
    assert prefix is not None
    model: Any = vlm.loaded.model
    runner = vlm.cached._runner
    n = (len(prompt) - 1) // BLOCK
    admission = prefix.cache.admit("probe", list(prompt), None, vision.cache_keys())
    try:
        assert admission.cached_tokens == n * BLOCK > vision.spans[0].start
        warm_cache = make_prompt_cache(model)
        prefix.store.assemble(list(admission.block_ids), warm_cache)
        rest = list(prompt[n * BLOCK :])
        warm = runner.last_logits(warm_cache, rest, vision, n * BLOCK)
        cold = runner.last_logits(make_prompt_cache(model), list(prompt), vision, 0)
        assert mx.abs(cold).max().item() > 0.1
        assert mx.abs(warm - cold).max().item() < 1e-3
    finally:
        prefix.cache.release("probe")


def test_a_resent_image_does_not_rerun_the_encoder(vlm: Vlm) -> None:
    prompt, vision = vlm.request("Once more: what is it?", image(10))
    before = vlm.uncached.vision_encoder_runs
    assert vision is not None
    encoded = len(vision.spans)  # one encoder run per image, or per tile of a tiled one
    run(vlm.uncached, prompt, vision)
    assert vlm.uncached.vision_encoder_runs == before + encoded
    # No prefix cache on this engine: the whole image prefills again, from the LRU.
    run(vlm.uncached, prompt, vision)
    assert vlm.uncached.vision_encoder_runs == before + encoded


def test_images_for_a_text_only_model_are_refused(embedded_model: LoadedModel, vlm: Vlm) -> None:
    engine = Engine(embedded_model, EngineConfig())
    engine.start()
    try:
        prompt, vision = vlm.request("Describe this picture.", image(1))

        async def submit() -> None:
            engine.submit(EngineRequest("t", prompt, SamplingParams(max_tokens=1), vision=vision))

        with pytest.raises(ValueError, match="text-only"):
            asyncio.run(submit())
    finally:
        engine.shutdown()


def test_a_text_prompt_spelling_the_placeholders_never_reads_an_image(vlm: Vlm) -> None:
    """Placeholder ids are the same for every image: only block hashes tell images
    apart, so no partial (token-id) match may read into a cached image."""
    prompt, vision = vlm.request("Spell the placeholders.", image(11))
    assert vision is not None
    run(vlm.cached, prompt, vision)
    span = vision.spans[0]
    tokens, usage = run(vlm.cached, prompt)  # the same ids, as text
    assert usage.cached_tokens <= span.start
    assert_same_or_near_tie(vlm, prompt, None, run(vlm.uncached, prompt)[0], tokens)


def test_the_feature_lru_is_bounded_by_bytes(vlm: Vlm) -> None:
    from compat_serve.engine.vision import FeatureCache

    model: Any = vlm.loaded.model
    spans = [vlm.request("x", image(20 + i))[1].spans[0] for i in range(3)]  # type: ignore[union-attr]
    one = model.encode_image(spans[0].pixel_values, spans[0].grid).nbytes
    lru = FeatureCache(model, max_bytes=2 * one)
    for span in spans:
        lru.get(span)
    assert lru.encoder_runs == 3 and lru.bytes_in_use == 2 * one
    lru.get(spans[2])  # still there
    assert lru.encoder_runs == 3 and lru.hits == 1
    lru.get(spans[0])  # the least recently used went first
    assert lru.encoder_runs == 4
