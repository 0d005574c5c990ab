#!/usr/bin/env bash
# make gpu-kit-check: the kit on a stand-in for the device, here, at no device time.
# Python 3.12 with the device's own packages (versions as KINDS.md read them there), the
# parts reassembled and unpacked as device.sh does, then `run.py --smoke` on that site.
# The one swap: mlx's CUDA library for the CPU one of the same version (no GPU here).
# Needs a python3.12 (PYTHON312=/path, else python3.12 on PATH or pyenv's); downloads the
# stand-in's packages from PyPI into .gpu-kit/check/ (ignored).
set -euo pipefail
PY312=
for candidate in ${PYTHON312:-} python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    PY312=$candidate && break
  fi  # (a pyenv shim may exist and still fail: each candidate must run)
done
[ -n "$PY312" ] || { echo "no python3.12 here: set PYTHON312"; exit 2; }
CHECK=.gpu-kit/check
SITE=$CHECK/unpacked/site
rm -rf "$CHECK" && mkdir -p "$CHECK"
"$PY312" -m venv "$CHECK/venv"
"$CHECK/venv/bin/pip" install -q numpy==2.5.2 tokenizers==0.23.2 transformers==5.17.0 \
  safetensors==0.8.0 jinja2 pyyaml msgpack httpx protobuf sentencepiece anyio click h11
cat .gpu-kit/call*/payload.part* | "$PY312" -c "
import hashlib, json, sys, tarfile
data = sys.stdin.buffer.read()
manifest = json.load(open('.gpu-kit/manifest.json'))
assert hashlib.sha256(data).hexdigest() == manifest['payload_sha256'], 'parts do not make the payload'
import io
tarfile.open(fileobj=io.BytesIO(data), mode='r:xz').extractall('$CHECK/unpacked', filter='data')
print('payload ok:', len(data), 'bytes')
"
rm -rf "$SITE/mlx/lib" "$SITE/mlx_cuda_13.libs" "$SITE"/mlx_cuda_13-*.dist-info
"$CHECK/venv/bin/pip" install -q --no-deps --target "$CHECK/mlx-cpu" mlx-cpu==0.32.4
cp -a "$CHECK/mlx-cpu/mlx/lib" "$SITE/mlx/lib"
cp -a "$CHECK"/mlx-cpu/mlx_cpu* "$SITE/"
PYTHONPATH=$SITE "$CHECK/venv/bin/python" -c "import compat_serve.server, compat_serve.cli; print('server stack imports')"
PYTHONPATH=$SITE "$CHECK/venv/bin/python" benches/gpu/run.py --smoke --out "$CHECK/out" \
  --kit .gpu-kit/call1 --budget-s 120
echo "kit check ok: $CHECK/out/gpu-bench.md"
