"""Multi-token prediction (`--speculative mtp`): a one-layer head drafts the next tokens
from the main model's last hidden state.

An MTP head (DeepSeek-V3's layout, which GLM-4.5 and llama.cpp's `nextn` tensors share)
predicts token t+2 from the main model's hidden state at position t and the embedding of
token t+1: `x = eh_proj(cat(enorm(embed(tok)), hnorm(hidden)))`, one decoder layer,
`logits = head(shared_head.norm(x))`. The embedding and the vocabulary head are the main
model's own modules (shared, not copied); the head's own weights are the norms, the
projection and the layer. For k > 1 the head chains on its own output `x`.

The hidden state handed over is the main model's final-norm output, the tensor its LM
head reads (vllm's `DeepseekV2Model.forward` returns `self.norm(...)` and hands that to
its MTP proposer). It is captured from the forward the engine already runs: the final
norm's class is switched to a subclass that keeps its latest outputs (`HiddenCapture`), so
parameters, names and shapes stay as they were.

The head's layer attends over the row's earlier positions through its own KV cache, as
the reference implementations (vllm's `deepseek_mtp.py`, EAGLE-style MTP) run it and as
the checkpoints were trained: engine/mtp_cache.py keeps that cache per row, fed with the
pair (hidden[t], token[t+1]) for every position the main model computes, and drafts on it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx.nn.layers.base import Module
from mlx.nn.layers.linear import Linear
from mlx.nn.layers.normalization import RMSNorm
from mlx.nn.layers.quantized import QuantizedLinear
from mlx.utils import tree_flatten
from mlx_lm.models import llama
from mlx_lm.models.base import create_attention_mask

from compat_serve.models.errors import ModelLoadError
from compat_serve.models.weights import dequantize, infer_quant_params, param_shapes

log = logging.getLogger("compat_serve.engine")

# Families whose checkpoints ship MTP weights (issue #45), for the start-up error.
MTP_FAMILIES = "DeepSeek-V3/R1, GLM-4.5/4.6/4.7, Qwen3-Next/Qwen3.5/Qwen3.6, MiMo"
# A trained head file's optional tensor: the token ids its drafts are chosen among.
DRAFT_VOCAB = "draft_vocab"


class MTPHeadError(ValueError):
    """No MTP head for this model, or a head file that does not fit it."""


# Outputs a capture keeps: a chunk's `last_logits` runs two forwards (all but the last
# token, then the last), and the head's cache needs both.
KEPT_OUTPUTS = 2


class _Slot:
    """Holds the latest captured hidden states, newest last (a plain object: an `mx.array`
    attribute of a module would become one of its parameters)."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: deque[mx.array] = deque(maxlen=KEPT_OUTPUTS)


_capturing_classes: dict[type, type] = {}


def _capturing_class(cls: type) -> type:
    made = _capturing_classes.get(cls)
    if made is None:

        def __call__(self: Any, x: mx.array) -> mx.array:  # noqa: N807
            out: mx.array = cls.__call__(self, x)
            self._mtp_slot.values.append(out)
            return out

        made = type(f"Capturing{cls.__name__}", (cls,), {"__call__": __call__})
        _capturing_classes[cls] = made
    return made


def final_norm(model: Module) -> Module | None:
    """The inner model's final norm (`model.model.norm` in mlx-lm's text models)."""
    inner = getattr(model, "model", None)
    norm = getattr(inner, "norm", None)
    return norm if isinstance(norm, Module) else None


class HiddenCapture:
    """Keeps the output of the main model's final norm from its latest forwards (the last
    `KEPT_OUTPUTS`): `[rows, positions, hidden]` each."""

    def __init__(self, model: Module) -> None:
        norm = final_norm(model)
        if norm is None:
            raise MTPHeadError("the model has no final norm to take hidden states from")
        slot = getattr(norm, "_mtp_slot", None)
        if slot is None:
            slot = _Slot()
            object.__setattr__(norm, "_mtp_slot", slot)
            norm.__class__ = _capturing_class(type(norm))
        self._slot: _Slot = slot

    @property
    def last(self) -> mx.array:
        return self.latest(1)[0]

    def latest(self, count: int) -> list[mx.array]:
        """The outputs of the last `count` forwards, oldest first."""
        values = self._slot.values
        assert 0 < count <= len(values), f"{count} forwards wanted, {len(values)} captured"
        return list(values)[-count:]


class _SharedHead(Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.norm = RMSNorm(hidden, eps=eps)


class MTPLayer(llama.TransformerBlock):
    """The head's own weights, named as in a DeepSeek-V3 MTP layer without its
    `model.layers.{L}.` prefix: the decoder layer's tensors, `enorm`, `hnorm`, `eh_proj`
    and `shared_head.norm` (the embedding and vocabulary head are the main model's)."""

    def __init__(self, args: llama.ModelArgs) -> None:
        super().__init__(args)
        hidden, eps = args.hidden_size, args.rms_norm_eps
        self.enorm = RMSNorm(hidden, eps=eps)
        self.hnorm = RMSNorm(hidden, eps=eps)
        self.eh_proj = Linear(2 * hidden, hidden, bias=False)
        self.shared_head = _SharedHead(hidden, eps)


def llama_head_args(model: Module) -> llama.ModelArgs:
    """A one-layer llama config sized like the main model (its `args`)."""
    args = model.args
    return llama.ModelArgs(
        model_type="llama",
        hidden_size=args.hidden_size,
        num_hidden_layers=1,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        rms_norm_eps=args.rms_norm_eps,
        vocab_size=args.vocab_size,
        head_dim=getattr(args, "head_dim", None),
        rope_theta=getattr(args, "rope_theta", 10000.0),
        rope_traditional=getattr(args, "rope_traditional", False),
        tie_word_embeddings=True,
    )


def embedding_and_head(
    model: Module,
) -> tuple[Callable[[mx.array], mx.array], Callable[[mx.array], mx.array]]:
    """The main model's token embedding and its vocabulary head (the tied embedding's
    `as_linear` when the model ties them)."""
    embed = model.model.embed_tokens
    lm_head = _lm_head(model)
    if lm_head is not None:
        return embed, lm_head
    return embed, embed.as_linear


# (the head's module, the embedded tokens [B, L, H] or [B, H], the hidden states alike,
# the layer's KV cache or None) -> (the vocabulary head's input, the hidden state the next
# step chains on), shaped as the input
Compose = Callable[[Module, mx.array, mx.array, Any], tuple[mx.array, mx.array]]


def run_block(block: Module, x: mx.array, cache: Any) -> mx.array:
    """The decoder layer over `x` (`[B, H]`: one position; `[B, L, H]`: L positions, causal)
    with its KV cache (None: no earlier positions)."""
    one = x.ndim == 2
    x = x[:, None, :] if one else x
    mask = create_attention_mask(x, cache, return_array=True)
    out: mx.array = block(x, mask, cache)
    return out[:, 0, :] if one else out


def deepseek_compose(
    layer: Module, embedded: mx.array, hidden: mx.array, cache: Any = None
) -> tuple[mx.array, mx.array]:
    """DeepSeek-V3's MTP step on an `MTPLayer`: chains on the layer's un-normed output."""
    e = layer.enorm(embedded)
    h = layer.hnorm(hidden.astype(e.dtype))
    x = run_block(layer, layer.eh_proj(mx.concatenate([e, h], axis=-1)), cache)
    return layer.shared_head.norm(x), x


class MTPHead:
    """One MTP step for a batch: `(hidden [B, H], tokens [B]) -> (logits [B, V], hidden)`,
    with the layer's KV cache (`cache`: the row's earlier positions) or without. `layer`
    holds the head's own weights; `compose` is its family's step (engine/mtp_families.py),
    DeepSeek-V3's by default.

    With a `draft_vocab` (token ids, a trained head file's `draft_vocab` tensor) the head
    scores those ids only, through their rows of the vocabulary head gathered once, and
    every other id gets -inf: FR-Spec's frequency-ranked drafting. Decoding is memory
    bound, and the tied 49k-row head is most of a draft's bytes; the main model still
    scores every id when it verifies, so output is unchanged."""

    def __init__(
        self,
        layer: Module,
        model: Module,
        compose: Compose | None = None,
        draft_vocab: mx.array | None = None,
    ) -> None:
        self.layer = layer
        self._compose = compose or deepseek_compose
        self._embed, self._head = embedding_and_head(model)
        self.draft_vocab = draft_vocab
        # The draft vocabulary's ids with their rows of the vocabulary head, gathered once.
        self._draft = None if draft_vocab is None else (draft_vocab, head_rows(model, draft_vocab))
        self._vocab = vocabulary_rows(model)

    def step(
        self, hidden: mx.array, tokens: mx.array, cache: Any = None
    ) -> tuple[mx.array, mx.array]:
        normed, chained = self._compose(self.layer, self._embed(tokens), hidden, cache)
        if self._draft is None:
            return self._head(normed), chained
        ids, rows = self._draft
        scores = normed @ rows.T
        logits = mx.full((scores.shape[0], self._vocab), -mx.inf, dtype=scores.dtype)
        logits[:, ids] = scores
        return logits, chained

    def extend(self, hidden: mx.array, tokens: mx.array, cache: Any) -> None:
        """Run the layer over the pairs `(hidden [B, L, H], tokens [B, L])` to append them
        to `cache` (the vocabulary head is not run: its input stays unevaluated)."""
        self._compose(self.layer, self._embed(tokens), hidden, cache)


def _lm_head(model: Module) -> Module | None:
    # Qwen3.5's head sits on its language model (`model.language_model.lm_head`).
    head = getattr(getattr(model, "language_model", model), "lm_head", None)
    return head if isinstance(head, Module) else None


def vocabulary_rows(model: Module) -> int:
    """How many ids the model's vocabulary head scores (its logits' width)."""
    head = _lm_head(model)
    weight = (head if head is not None else model.model.embed_tokens).weight
    return int(weight.shape[0])


def head_rows(model: Module, ids: mx.array) -> mx.array:
    """The vocabulary head's rows for `ids`, dense `[len(ids), H]`: the tied embedding's
    (looked up, so a quantized one comes back dequantized) or the untied head's."""
    head = _lm_head(model)
    if head is None:
        rows: mx.array = model.model.embed_tokens(ids)
    elif isinstance(head, QuantizedLinear):
        biases = head.biases
        assert biases is not None  # mlx-lm's affine quantization keeps them
        rows = mx.dequantize(
            head.weight[ids], head.scales[ids], biases[ids], head.group_size, head.bits
        )
    else:
        rows = head.weight[ids]
    mx.eval(rows)
    return rows


def new_llama_head(model: Module) -> MTPLayer:
    """A randomly initialised head for `model` (tests; the training bench's start)."""
    layer = MTPLayer(llama_head_args(model))
    mx.eval(layer.parameters())
    return layer


def load_head(path: str | Path, model: Module) -> MTPHead:
    """The head saved at `path` (safetensors, `MTPLayer`'s tensor names) on `model`.
    Raises `MTPHeadError` naming the first missing tensor or a wrong shape."""
    layer = MTPLayer(llama_head_args(model))
    try:
        weights = mx.load(str(path))
    except (OSError, ValueError, RuntimeError) as exc:
        raise MTPHeadError(f"--mtp-head {path}: cannot read it as safetensors ({exc})") from None
    assert isinstance(weights, dict)
    draft_ids = weights.pop(DRAFT_VOCAB, None)
    dtype = model.model.norm.weight.dtype
    wanted = dict(tree_flatten(layer.parameters()))
    try:
        weights = dequantized(weights, param_shapes(layer), dtype)
    except ModelLoadError as exc:
        raise MTPHeadError(f"--mtp-head {path}: {exc}") from None
    for name, param in wanted.items():
        got = weights.get(name)
        if got is None:
            raise MTPHeadError(f"--mtp-head {path}: the MTP head has no tensor {name!r}")
        if tuple(got.shape) != tuple(param.shape):
            raise MTPHeadError(
                f"--mtp-head {path}: tensor {name!r} has shape {tuple(got.shape)}, "
                f"this model's head needs {tuple(param.shape)}"
            )
    layer.load_weights([(name, weights[name].astype(dtype)) for name in wanted])
    mx.eval(layer.parameters())
    return MTPHead(layer, model, draft_vocab=_draft_vocab(path, draft_ids, model))


def _draft_vocab(path: str | Path, ids: mx.array | None, model: Module) -> mx.array | None:
    if ids is None:
        return None
    vocab = vocabulary_rows(model)
    values = np.asarray(ids)
    if values.ndim != 1 or not values.size or values.min() < 0 or values.max() >= vocab:
        raise MTPHeadError(f"--mtp-head {path}: {DRAFT_VOCAB} must list token ids below {vocab}")
    return mx.array(values.astype(np.uint32))


QUANT_GROUP = 64


def quantize_head_weights(weights: dict[str, mx.array], bits: int) -> dict[str, mx.array]:
    """Each projection's weight as mlx-lm stores a quantized linear (`weight`, `scales`,
    `biases`; group 64); norms in float16."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if value.ndim == 2 and value.shape[-1] % QUANT_GROUP == 0:
            stem = name.removesuffix("weight")
            q, scales, biases = mx.quantize(value, group_size=QUANT_GROUP, bits=bits)
            out[name], out[stem + "scales"], out[stem + "biases"] = q, scales, biases
        else:
            out[name] = value.astype(mx.float16)
    return out


def dequantized(
    weights: dict[str, mx.array], shapes: Mapping[str, tuple[int, ...]], dtype: mx.Dtype
) -> dict[str, mx.array]:
    """`weights` with every quantized linear (`scales` and `biases` beside its `weight`)
    turned back into a dense weight, all in `dtype`: bits and group size inferred from the
    dense shape the head needs (`shapes`, its parameters') as the model loaders do.
    Raises `ModelLoadError` when a packed weight fits no quantization of that shape."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        if name.endswith(("scales", "biases")):
            continue
        stem = name.removesuffix("weight")
        scales, biases = weights.get(stem + "scales"), weights.get(stem + "biases")
        if scales is not None and biases is not None and name in shapes:
            params = infer_quant_params(value, scales, shapes[name][-1], name=name)
            out[name] = dequantize(value, scales, biases, params, dtype)
        else:
            out[name] = value.astype(dtype)
    return out
