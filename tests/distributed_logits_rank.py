"""One rank of the logits check (tests/python/test_distributed.py): joins the ring group
once, then for each MODEL_DIR MODE OUT triple of its arguments loads its shard of MODEL_DIR
with `--distributed`'s loader, runs `forwards()` and, on rank 0, saves the logits to
OUT.npy (one process per rank for every layout: its imports are most of its cost). Run
with no MLX_RANK it loads each whole model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

PROMPT = [(7 * i + 3) % 1000 + 10 for i in range(40)]


def forwards(model: object) -> np.ndarray:
    """Two prefill chunks, then three decode steps of fixed tokens: every position's
    logits of the last chunk and each decode step's, stacked."""
    cache = make_prompt_cache(model)
    outs = []
    for chunk in (PROMPT[:24], PROMPT[24:]):
        logits = model(mx.array(chunk, dtype=mx.uint32)[None], cache=cache)  # type: ignore[operator]
        mx.eval(logits)
    outs.append(logits[0])
    for token in (11, 12, 13):
        logits = model(mx.array([[token]], dtype=mx.uint32), cache=cache)  # type: ignore[operator]
        mx.eval(logits)
        outs.append(logits[0])
    return np.array(mx.concatenate(outs, axis=0).astype(mx.float32))


def main() -> None:
    triples = sys.argv[1:]
    assert triples and len(triples) % 3 == 0, "arguments: (MODEL_DIR MODE OUT)..."
    group = None
    if "MLX_RANK" in os.environ:
        from compat_serve.distributed.group import join_group

        group = join_group()
    for i in range(0, len(triples), 3):
        model_dir, mode, out = Path(triples[i]), triples[i + 1], triples[i + 2]
        if group is not None:
            from compat_serve.distributed.loading import load_sharded

            loaded = load_sharded(model_dir, mode, group)
            rank = group.rank()
        else:
            from compat_serve.models.hf_dir import load_hf_dir

            loaded = load_hf_dir(model_dir)
            rank = 0
        logits = forwards(loaded.model)
        if rank == 0:
            np.save(out, logits)


if __name__ == "__main__":
    main()
