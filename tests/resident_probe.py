"""Run as a script: load a model as the server does and print, as JSON, how much the
process's resident set grew (VmRSS), beside the figures compat-serve reports for it, and
which mlx_vlm modules the process imported (none: the text-only install never needs it).
A subprocess so nothing else the test session holds is counted, and nothing it imported
is seen (tests/python/test_resident_size.py)."""

from __future__ import annotations

import json
import re
import sys


def vm_rss() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        found = re.search(r"VmRSS:\s+(\d+) kB", f.read())
    assert found is not None
    return int(found.group(1)) * 1024


def main(path: str, dtype: str, budget: str | None) -> None:
    from compat_serve.models.blas import ensure_fast_blas

    ensure_fast_blas()
    # Everything a load imports, imported first: code is not what a model holds. The
    # server, the CLI and the engine too, for the check that none of them imports mlx_vlm.
    import mlx.core as mx
    import mlx_lm.models.gemma3_text
    import mlx_lm.models.llama  # noqa: F401
    from mlx.utils import tree_flatten

    import compat_serve.cli
    import compat_serve.engine.engine
    import compat_serve.models.gguf
    import compat_serve.models.hf_dir
    import compat_serve.server.app  # noqa: F401
    from compat_serve.bootstrap import ServeOptions, build_state
    from compat_serve.models.device_memory import collect_memory
    from compat_serve.models.resident_size import estimate_resident_bytes
    from compat_serve.registry.slots import resident_bytes

    spec = None if path == "embedded" else path
    budget_bytes = int(budget) if budget else None
    collect_memory()
    before = vm_rss()
    state = build_state(
        ServeOptions(model=spec, dtype=dtype, memory_budget_bytes=budget_bytes, prefix_cache=True)
    )
    mx.eval([a for _, a in tree_flatten(state.engine.model.model.parameters())])
    collect_memory()
    after = vm_rss()
    print(
        json.dumps(
            {
                "growth": after - before,
                "resident_bytes": resident_bytes(state),
                "estimate": estimate_resident_bytes(spec, dtype),
                "dtype": state.engine.model.dtype,
                "weights": state.engine.memory.weights,
                "auto_note": state.engine.model.extra.get("dtype_auto"),
                "mlx_vlm_modules": sorted(m for m in sys.modules if m.split(".")[0] == "mlx_vlm"),
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
