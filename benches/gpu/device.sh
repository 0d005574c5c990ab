#!/usr/bin/env bash
# The GPU kit on the lent device (#35), called from the repository root by the `device`
# tool's calls listed in benches/gpu/README.md:
#   bash benches/gpu/device.sh receive K   a part arrived: check it, report the machine
#   bash benches/gpu/device.sh run         the last part: unpack, check, run benches/gpu/run.py
# Parts of earlier calls stay on the machine (ignored files survive between calls while
# it is warm). Nothing is installed outside /tmp.
set -uo pipefail
KIT=.gpu-kit
SITE=/tmp/gpu-kit/site
OUT=${OUT:-/tmp/gpu-kit-out}

part_ok() {  # part_ok FILE: its size and checksum match the manifest it came with
  python3 - "$1" <<'EOF'
import hashlib, json, pathlib, sys
part = pathlib.Path(sys.argv[1])
manifest = json.loads((part.parent / "manifest.json").read_text())
want = manifest["parts"][part.name]
digest = hashlib.sha256(part.read_bytes()).hexdigest()
ok = part.stat().st_size == want["bytes"] and digest == want["sha256"]
print(f"{part}: {part.stat().st_size} bytes, sha256 {'ok' if ok else 'MISMATCH'}")
sys.exit(0 if ok else 1)
EOF
}

report_parts() {
  local missing=0 expected
  expected=$(python3 -c "import json,glob; m=json.load(open(sorted(glob.glob('$KIT/call*/manifest.json'))[-1])); print(len(m['parts']))")
  for k in $(seq 1 "$expected"); do
    if [ -f "$KIT/call$k/payload.part$k" ]; then part_ok "$KIT/call$k/payload.part$k" || missing=1
    else echo "part $k: MISSING (the machine went back between calls: start again at call 1)"; missing=1; fi
  done
  return $missing
}

case "${1:-}" in
receive)
  part_ok "$KIT/call$2/payload.part$2" || exit 1
  if [ "$2" = 1 ]; then  # the facts the run relies on, at no extra call
    nvidia-smi -L; python3 --version; df -h /tmp | tail -1
    python3 -c "import sysconfig; print('purelib', sysconfig.get_paths()['purelib'])"
    ls "$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia"
  fi
  ;;
run)
  report_parts || exit 1
  rm -rf /tmp/gpu-kit && mkdir -p /tmp/gpu-kit "$OUT"
  started=$(date +%s)
  cat "$KIT"/call*/payload.part* | python3 -c "
import sys, tarfile
tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/gpu-kit', filter='data')
" || exit 1
  echo "unpacked in $(($(date +%s) - started)) s: $(du -sh /tmp/gpu-kit | cut -f1)"
  # libmlx.so finds the CUDA libraries through RPATH $ORIGIN/../../nvidia/*/lib, i.e. beside
  # its own site-packages: point that at the device's (torch's) CUDA 13 wheels.
  purelib=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  ln -sfn "$purelib/nvidia" "$SITE/nvidia"
  LD_LIBRARY_PATH=$(find -L "$purelib/nvidia" -maxdepth 2 -type d -name lib | tr '\n' ':')${LD_LIBRARY_PATH:-}
  export LD_LIBRARY_PATH PYTHONPATH=$SITE PYTHONUNBUFFERED=1
  if ! python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device(), mx.device_info())"; then
    echo "mlx does not load: what libmlx.so misses, and the CUDA wheels there:"
    ldd "$SITE/mlx/lib/libmlx.so" | grep "not found"; ls "$purelib/nvidia" "$purelib/nvidia/"*/
    exit 1
  fi
  timeout 540 python3 benches/gpu/run.py --out "$OUT" --kit "$KIT/call1" \
    --gguf "/tmp/gpu-kit/models/SmolLM2-135M-Instruct.Q4_1.gguf" ${RUN_ARGS:-}
  status=$?
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
  echo "run.py exit $status after $(($(date +%s) - started)) s; tables in \$OUT/gpu-bench.md"
  exit $status
  ;;
*)
  echo "usage: $0 receive K | run" >&2
  exit 2
  ;;
esac
