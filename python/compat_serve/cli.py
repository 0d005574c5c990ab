"""The `compat-serve` command: serve a model, or convert a GGUF file to an MLX directory."""

from __future__ import annotations

import argparse
import sys

from compat_serve.serve_command import serve, setup_logging
from compat_serve.serve_flags import build_serve_parser


def build_convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="compat-serve convert-gguf",
        description="Write an mlx-lm-loadable directory (config.json, safetensors, tokenizer, "
        "chat template) from a GGUF file of any family --model loads.",
    )
    p.add_argument("src", help="input .gguf file")
    p.add_argument("out_dir", help="output directory (created)")
    p.add_argument(
        "--dtype",
        default="quantized",
        choices=("quantized", "float32", "float16", "bfloat16"),
        help="keep the GGUF quantization (default) or write dense weights",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "convert-gguf":
        return _convert(build_convert_parser().parse_args(args[1:]))
    if args and args[0] == "codex-config":
        return _codex_config(args[1:])
    if args and args[0] == "launch":
        from compat_serve.launch.command import main as launch_main

        return launch_main(args[1:])
    return serve(build_serve_parser().parse_args(args))


def _convert(ns: argparse.Namespace) -> int:
    setup_logging("info")
    from compat_serve.models.blas import ensure_fast_blas

    ensure_fast_blas()
    from compat_serve.models.convert import convert_gguf

    convert_gguf(ns.src, ns.out_dir, dtype=ns.dtype)
    print(f"wrote {ns.out_dir}")
    return 0


def _codex_config(args: list[str]) -> int:
    from compat_serve.codex_config import CodexConfigError, build_parser, write_codex_config

    try:
        messages = write_codex_config(build_parser().parse_args(args))
    except CodexConfigError as exc:
        print(f"compat-serve codex-config: {exc}", file=sys.stderr)
        return 2
    print("\n".join(messages))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
