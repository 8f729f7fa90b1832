#!/usr/bin/env bash
# Weight streaming: the streamer against one sequential GET and raw parallel
# ranges, served by nginx with a per-connection rate limit (object stores cap
# each connection; that is why parallel ranges win), then through warmgate's
# /v1/weights endpoint cold and from the cache, then tensor-by-tensor
# loading (the Python kit and the embedder's loader) from the cache, then
# the embedder's cold start split into phases from a cold and a warm cache.
#
# Usage: benches/weights.sh   (env SIZE_MIB=2048, RATE=100m per connection;
#                              SMOKE=1 reads a 64 MiB checkpoint, the
#                              streamer at 2 settings, on the debug build,
#                              and fails unless every part read it whole)
set -euo pipefail
cd "$(dirname "$0")/.."
SMOKE=${SMOKE:-0}
# The streamer's settings weights-bench tries (its defaults unless smoke).
RUN_ARGS=()
if [ "$SMOKE" = 1 ]; then
  SIZE_MIB=${SIZE_MIB:-64} RATE=${RATE:-1000m} PROFILE=${PROFILE:-debug}
  RUN_ARGS=(--concurrency 1,4 --part-mib 8)
fi
SIZE_MIB=${SIZE_MIB:-2048}
RATE=${RATE:-100m}
PROFILE=${PROFILE:-release}

if ! command -v nginx >/dev/null 2>&1; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq nginx-light >/dev/null
fi
if [ "$PROFILE" = release ]; then
  cargo build --release --workspace --bins -q
else
  cargo build --workspace --bins -q
fi
BIN=$PWD/target/$PROFILE
WORK=$(mktemp -d /tmp/warmgate-wbench.XXXXXX)
OUT=${OUT:-$PWD/target/bench-results}
mkdir -p "$OUT" "$WORK/www" "$WORK/nginx"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx/nginx.pid" ] && kill -QUIT "$(cat "$WORK/nginx/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

echo "writing a ${SIZE_MIB} MiB checkpoint" >&2
"$BIN/weights-bench" gen --out "$WORK/www/model.safetensors" --size-mib "$SIZE_MIB"

PORT=$(free_port)
cat >"$WORK/nginx/nginx.conf" <<CONF
user root;
worker_processes 2;
daemon on;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/error.log warn;
events { worker_connections 1024; }
http {
  access_log off;
  sendfile on;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  server {
    listen 127.0.0.1:$PORT;
    root $WORK/www;
    limit_rate $RATE;
  }
}
CONF
nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf"
URL="http://127.0.0.1:$PORT/model.safetensors"

# warmgate, for its /v1/weights endpoint (the app never starts a worker).
# The endpoint needs a credential: the admin token, which weights-bench sends.
export WARMGATE_ADMIN_TOKEN="bench-$RANDOM$RANDOM"
cat >"$WORK/gw.toml" <<CONF
state_dir = "$WORK/state"
[[apps]]
name = "ck"
command = ["true"]
checkpoint = "$URL"
CONF
WARMGATE_LOG=warn "$BIN/warmgate" serve --config "$WORK/gw.toml" --listen 127.0.0.1:0 >"$WORK/gw.out" 2>"$WORK/gw.err" &
PIDS+=($!)
for _ in $(seq 1 200); do grep -q "listening on" "$WORK/gw.out" 2>/dev/null && break; sleep 0.02; done
GW=$(sed -n 's/^warmgate listening on //p' "$WORK/gw.out")
[ -n "$GW" ] || { cat "$WORK/gw.err" >&2; echo "warmgate did not start" >&2; exit 1; }

{
  echo "## Weight streaming (nginx, limit_rate $RATE per connection, ${SIZE_MIB} MiB checkpoint)"
  echo
  "$BIN/weights-bench" run --url "$URL" --gateway-url "$GW/v1/weights/ck/ck-00001/model.safetensors" \
    --cache-dir "$WORK/state/cache" "${RUN_ARGS[@]}"
} | tee "$OUT/weights.md"

# Tensor by tensor from the gateway's cache: the Python kit and the
# embedder's loader against a plain download of the same file. "First
# tensor" is when the first tensor was whole and handed on, and how much of
# the file had arrived then; the rest of the download overlaps the load.
GWF="$GW/v1/weights/ck/ck-00001/model.safetensors"
read -r PLAIN_CODE PLAIN <<<"$(curl -s -o /dev/null -w '%{http_code} %{time_total}' -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$GWF")"
# A worker on the gateway's machine: the manifest offers the cached file's
# path, and the kit reads it there. Against reading that file directly
# (into one buffer, as a loader would, from the page cache) and the kit
# over HTTP; three interleaved rounds, the median of each.
CACHED=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$GW/v1/weights/ck/ck-00001" |
  python3 -c 'import json,sys; print(next(f.get("path","") for f in json.load(sys.stdin)["files"] if f["name"]=="model.safetensors"))')
direct_read() {
  python3 - "$CACHED" <<'PY'
import os, sys, time
p = sys.argv[1]
n = os.path.getsize(p)
t = time.monotonic()
buf = bytearray(n)
view = memoryview(buf)
got = 0
with open(p, "rb", buffering=0) as f:
    while got < n:
        got += f.readinto(view[got:got + (64 << 20)])
print(time.monotonic() - t)
PY
}
RAWS=(); KITS=(); KITLS=()
for _ in 1 2 3; do
  RAWS+=("$(direct_read)")
  KITLS+=("$(STREAM_PROBE_DIGEST=0 python3 examples/python/stream_probe.py "$GW/v1/weights/ck/ck-00001" "$WARMGATE_ADMIN_TOKEN")")
  KITS+=("$(STREAM_PROBE_DIGEST=0 STREAM_PROBE_LOCAL=0 python3 examples/python/stream_probe.py "$GW/v1/weights/ck/ck-00001" "$WARMGATE_ADMIN_TOKEN")")
done
# The median round of each, by seconds.
median_json() { python3 -c 'import json,sys; r=sorted((json.loads(a) for a in sys.argv[1:]), key=lambda s: s["seconds"]); print(json.dumps(r[len(r)//2]))' "$@"; }
RAW=$(printf '%s\n' "${RAWS[@]}" | sort -n | sed -n 2p)
KIT=$(median_json "${KITS[@]}")
KITL=$(median_json "${KITLS[@]}")
# The loader sends its token only to the gateway that started it: this one.
RUST=$(WARMGATE_GATEWAY_URL="$GW" WARMGATE_WEIGHTS_TOKEN="$WARMGATE_ADMIN_TOKEN" "$BIN/weights-bench" stream --url "$GWF")
{
  echo
  echo "## Tensor by tensor from the gateway's cache (${SIZE_MIB} MiB, 64 MiB tensors)"
  echo
  echo "| reader | total (s) | vs plain download | first tensor (s) | bytes in at first tensor | peak RSS / size |"
  echo "|---|---:|---:|---:|---:|---:|"
  python3 - "$PLAIN" "$KIT" "$RUST" "$KITL" <<'PY'
import json, sys
plain = float(sys.argv[1])
print(f"| plain download (curl, discarded) | {plain:.2f} | 1.00 | — | — | — |")
for name, raw in (("Python kit over HTTP (`stream_checkpoint`)", sys.argv[2]), ("embedder loader (`Fetcher::stream_safetensors`)", sys.argv[3]), ("Python kit, local path (worker on the gateway's machine)", sys.argv[4])):
    s = json.loads(raw)
    rss = s.get("peak_rss_bytes")
    rss = f"{rss / s['bytes']:.2f}" if rss else "—"
    print(f"| {name} | {s['seconds']:.2f} | {s['seconds'] / plain:.2f} | {s['first_tensor_s']:.3f} | "
          f"{100 * s['first_tensor_bytes'] / s['bytes']:.1f}% | {rss} |")
PY
} | tee -a "$OUT/weights.md"
{
  echo
  echo "## A warm-cache load against reading the file directly (${SIZE_MIB} MiB, median of 3 interleaved rounds)"
  echo
  echo "| load | seconds | speed vs reading the file directly |"
  echo "|---|---:|---:|"
  python3 - "$RAW" "$KIT" "$KITL" "$OUT/weights-local.json" "$SIZE_MIB" <<'PY'
import json, sys
raw = float(sys.argv[1])
http, local = json.loads(sys.argv[2]), json.loads(sys.argv[3])
print(f"| the cached file read directly (Python `readinto`, one buffer) | {raw:.2f} | 1.00 |")
print(f"| Python kit, local path (`local_files` = {local['local_files']}) | {local['seconds']:.2f} | {raw / local['seconds']:.2f} |")
print(f"| Python kit over HTTP from the cache | {http['seconds']:.2f} | {raw / http['seconds']:.2f} |")
json.dump({"size_mib": int(sys.argv[5]), "direct_s": raw, "kit_local_s": local["seconds"],
           "kit_http_s": http["seconds"], "local_vs_direct": raw / local["seconds"],
           "http_vs_direct": raw / http["seconds"]}, open(sys.argv[4], "w"))
PY
} | tee -a "$OUT/weights.md"

# The embedder's cold start, from a cold and from a warm cache.
if [ -f checkpoints/minilm/model.safetensors ]; then
  cat >"$WORK/mini.toml" <<CONF
state_dir = "$WORK/mini-state"
[[apps]]
name = "minilm"
command = ["$BIN/embedder"]
checkpoint = "file://$PWD/checkpoints/minilm"
[apps.autoscale]
scale_to_zero_after = "1s"
stable_window = "2s"
panic_window = "1s"
CONF
  WARMGATE_LOG=warn "$BIN/warmgate" serve --config "$WORK/mini.toml" --listen 127.0.0.1:0 >"$WORK/mini.out" 2>"$WORK/mini.err" &
  PIDS+=($!)
  for _ in $(seq 1 200); do grep -q "listening on" "$WORK/mini.out" 2>/dev/null && break; sleep 0.02; done
  MG=$(sed -n 's/^warmgate listening on //p' "$WORK/mini.out")
  [ -n "$MG" ] || { cat "$WORK/mini.err" >&2; echo "warmgate (minilm) did not start" >&2; exit 1; }
  # The status code, then the seconds.
  req() { curl -s -o /dev/null -w '%{http_code} %{time_total}' "$MG/v1/embeddings" -d '{"model":"minilm","input":"warm pools"}'; }
  phases() { curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$MG/v1/status" | python3 -c '
import json,sys
c=json.load(sys.stdin)["apps"][0]["pool"]["last_cold_start"]
s, r = c["spawn_seconds"] * 1e3, c["ready_seconds"] * 1e3
print("spawn %.1f ms, spawn to ready %.0f ms" % (s, r))'; }
  read -r C1 T1 <<<"$(req)"
  P1=$(phases)
  for _ in $(seq 1 300); do
    n=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$MG/v1/status" | python3 -c 'import json,sys; print(len(json.load(sys.stdin)["apps"][0]["pool"]["replicas"]))')
    [ "$n" = 0 ] && break; sleep 0.05
  done
  SCALED_TO_ZERO=$n
  read -r C2 T2 <<<"$(req)"
  P2=$(phases)
  mapfile -t LINES < <(grep -h "embedder:" "$WORK"/mini-state/logs/*.log)
  {
    echo
    echo "## Embedder cold start (all-MiniLM-L6-v2, 91 MB)"
    echo
    echo "| start | first request (s) | pool manager | worker log |"
    echo "|---|---:|---|---|"
    echo "| cold cache | $T1 | $P1 | ${LINES[0]:-?} |"
    echo "| warm cache | $T2 | $P2 | ${LINES[1]:-?} |"
  } | tee -a "$OUT/weights.md"
fi

if [ "$SMOKE" = 1 ]; then
  # The smoke run's figures mean nothing; that every part read the whole
  # checkpoint, and cleanly, does.
  fail() { echo "weights smoke: $*" >&2; exit 1; }
  [ "$PLAIN_CODE" = 200 ] || fail "the plain download from the gateway answered $PLAIN_CODE"
  [ -n "$CACHED" ] && [ -f "$CACHED" ] || fail "the manifest offers no cached path ('$CACHED')"
  BYTES=$(( ${SIZE_MIB} + 63 )); BYTES=$(( BYTES / 64 * 64 << 20 ))
  python3 - "$BYTES" "$KIT" "$KITL" "$RUST" "$RAW" "$OUT/weights-local.json" <<'PY'
import json, sys
size = int(sys.argv[1])
# Every tensor's bytes (the kit counts tensors' bytes, the loader holds them).
for name, raw, key in (("kit over HTTP", sys.argv[2], "bytes"), ("kit, local path", sys.argv[3], "bytes"),
                       ("embedder loader", sys.argv[4], "held")):
    s = json.loads(raw)
    assert s[key] == size and s["tensors"] == size >> 26, f"{name} read {s[key]} of {size} bytes: {s}"
    assert s["first_tensor_s"] is not None, f"{name}: no first tensor: {s}"
assert json.loads(sys.argv[3])["local_files"] >= 1, "the kit did not read the cached file where it lies"
assert float(sys.argv[5]) > 0, "no direct read"
json.load(open(sys.argv[6]))
PY
  for want in "one sequential GET" "raw ranges c=4" "streamer c=4 part=8MiB" "warmgate /v1/weights, cold" \
      "warmgate /v1/weights, warm" "plain download (curl" "Python kit, local path"; do
    grep -qF "$want" "$OUT/weights.md" || fail "no '$want' in weights.md"
  done
  if [ -f checkpoints/minilm/model.safetensors ]; then
    [ "$C1" = 200 ] && [ "$C2" = 200 ] || fail "the embedder answered $C1 (cold cache), $C2 (warm cache)"
    [ "$SCALED_TO_ZERO" = 0 ] || fail "the embedder did not scale to zero between its two starts"
    [ -n "${LINES[0]:-}" ] && [ -n "${LINES[1]:-}" ] || fail "the embedder did not log both starts"
  else
    echo "weights smoke: no checkpoints/minilm (examples/fetch-minilm.sh): the embedder's cold start was not run" >&2
  fi
  echo "weights smoke: ok" >&2
fi
