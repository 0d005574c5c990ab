"""The real Gemma 3 270M Q4_K_M file, served by compat-serve on both `--dtype` loads, against
llama.cpp on the same file: prompt token ids and counts, the one BOS of text and chat
prompts, greedy continuations (tie-aware) and a prompt past Gemma 3's 512-token sliding
window (alone, batched, repeated from the prefix cache)."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from compat_serve.chat.prompt import PromptBuilder
from tests.extended import EXTENDED
from tests.greedy_ties import assert_greedy_equal_up_to_tie
from tests.llamacpp.corpus import LONG_TEXT, MULTILINGUAL, PROMPTS
from tests.llamacpp.reference import Greedy, LlamaCpp
from tests.shared_data import templates_dir

if TYPE_CHECKING:
    from compat_serve.models.types import LoadedModel
    from tests.conftest import RunningServer

# llama.cpp's CPU matmuls round every activation row to 8 bits (q8_0 / q8_K blocks, a step
# of max/127) before the quantized dot products; compat-serve multiplies float32 (or
# float16 scales on the users' path) activations. One 8-bit rounding of each layer's
# inputs moves a logit by a few hundredths on this model (benches/gguf_vs_llamacpp.py
# reports the mean |Δ logprob| of llama.cpp's top token); a real departure (a wrong layer,
# a missing window) picks a token whole logits down.
LLAMACPP_TIE = 0.25
GREEDY_TOKENS = 12


# The users' path (MLX's CPU quantized matmul, ~15x slower than dense here) runs the short
# prompts only; the long window is the same code on both loads.
DEFAULT_LOAD_ONLY = pytest.mark.parametrize("gemma_model", ["auto"], indirect=True)


def completion(server: RunningServer, prompt_ids: Sequence[int], n: int) -> dict[str, Any]:
    body = {
        "model": "gemma",
        "prompt": list(prompt_ids),
        "max_tokens": n,
        "temperature": 0.0,
        "logprobs": 5,
        "ignore_eos": True,
    }
    response = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


def assert_like_llamacpp(reference: Greedy, body: dict[str, Any], what: str) -> None:
    tokens = body["choices"][0]["logprobs"]["tokens"]
    assert_greedy_equal_up_to_tie(
        reference.texts, tokens, lambda i: reference.top[i], tolerance=LLAMACPP_TIE, what=what
    )


def rendered_ids(server: RunningServer, text: str) -> list[int]:
    """The prompt ids /v1/completions would serve `text` with (its render route: the same
    checks and tokenization, nothing generated)."""
    body = {"model": "gemma", "prompt": text, "max_tokens": 1, "temperature": 0.0}
    response = httpx.post(f"{server.base_url}/v1/completions/render", json=body, timeout=600)
    assert response.status_code == 200, response.text
    [request] = response.json()
    ids: list[int] = request["token_ids"]
    return ids


def test_prompt_token_counts_equal_llamacpp(
    llamacpp: LlamaCpp, gemma_model: LoadedModel, gemma_server: RunningServer
) -> None:
    """Text prompts (with the BOS the file's `add_bos_token` asks for) are the ids
    llama.cpp's tokenizer makes of them, and a completion's usage counts them."""
    for text in MULTILINGUAL:
        expected = llamacpp.tokenize(text)
        assert rendered_ids(gemma_server, text) == expected, repr(text)
        assert gemma_model.tokenizer.encode(text, add_special_tokens=True) == expected, repr(text)
    # Generating one token after the control tokens written as text.
    text = MULTILINGUAL[-1]
    body = {"model": "gemma", "prompt": text, "max_tokens": 1, "temperature": 0.0}
    response = httpx.post(f"{gemma_server.base_url}/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == len(llamacpp.tokenize(text))


# BOS on text no chat template wraps (#43: completions used to start one token short and
# answer " France. France. ..."); the embedded SmolLM2, whose metadata asks for none, is
# tests/python/test_text_bos_reference.py's.
BOS_TEXTS = [
    "The capital of France is",
    "  leading spaces, then\ttabs\nand lines",
    "Zürich, 東京, emoji 👩‍💻",
    "<start_of_turn>user\nHi<end_of_turn>",
]


def test_gemma_text_starts_with_one_bos_as_llamacpp(
    llamacpp: LlamaCpp, gemma_model: LoadedModel
) -> None:
    tokenizer = gemma_model.tokenizer
    assert tokenizer.add_bos_token and tokenizer.bos_token == "<bos>"
    bos = tokenizer.bos_token_id
    builder = PromptBuilder(None, tokenizer)  # the base model has no chat template
    for text in BOS_TEXTS:
        ids = builder.encode_text(text)
        assert ids == llamacpp.tokenize(text), text
        assert ids[0] == bos and ids[1] != bos
        # Typed BOS: one, not two (llama.cpp would add a second and warn).
        assert builder.encode_text("<bos>" + text) == ids
    # A template that writes {{ bos_token }} keeps exactly that one: the chat path never
    # adds another, and its ids equal llama.cpp's of the rendered text.
    template = (templates_dir() / "google-gemma-2-2b-it.jinja").read_text(encoding="utf-8")
    chat = PromptBuilder(template, tokenizer)
    text = chat.render([{"role": "user", "content": BOS_TEXTS[0]}])
    ids = chat.encode(text)
    assert ids[0] == bos and ids[1] != bos
    assert ids == llamacpp.tokenize(text, add_special=False)


def test_greedy_continuations_equal_llamacpp(
    llamacpp: LlamaCpp, gemma_server: RunningServer
) -> None:
    # CI: two of the four prompts (English, German) on the users' load, MLX's slow quantized
    # CPU matmul; the extended run takes all four on both loads (tests/extended.py).
    for text in PROMPTS if EXTENDED else PROMPTS[::2]:
        ids = llamacpp.tokenize(text)
        reference = llamacpp.greedy(ids, GREEDY_TOKENS)
        assert_like_llamacpp(reference, completion(gemma_server, ids, GREEDY_TOKENS), repr(text))


def test_gemma3_sliding_layers_keep_a_512_token_window(gemma_model: LoadedModel) -> None:
    from mlx_lm.models.cache import RotatingKVCache

    caches = gemma_model.model.make_cache()
    sliding = [c for c in caches if isinstance(c, RotatingKVCache)]
    assert len(sliding) == 15 and len(caches) == 18  # five local : one global, 18 layers
    assert {c.max_size for c in sliding} == {512}


@DEFAULT_LOAD_ONLY
def test_past_the_sliding_window_alone_batched_and_cached(
    llamacpp: LlamaCpp, gemma_server: RunningServer
) -> None:
    ids = llamacpp.tokenize(LONG_TEXT)
    assert 600 < len(ids) < 1000, len(ids)  # past the 512-token window, under ~1k
    reference = llamacpp.greedy(ids, GREEDY_TOKENS)
    assert_like_llamacpp(reference, completion(gemma_server, ids, GREEDY_TOKENS), "alone")

    others = [llamacpp.tokenize(text) for text in PROMPTS[:3]]
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(completion, gemma_server, p, GREEDY_TOKENS) for p in [ids, *others]]
        batched = futures[0].result()
        for f in futures[1:]:
            f.result()
    assert_like_llamacpp(reference, batched, "batched")

    again = completion(gemma_server, ids, GREEDY_TOKENS)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 512
    assert_like_llamacpp(reference, again, "from the prefix cache")
