#!/usr/bin/env bash
# Warm pools, measured against a baseline in the same run:
#
#   1. task dispatch overhead: POST /v1/pools/noop/tasks through warmgate
#      (1 tokio worker thread, pinned to CPU 0) against POST /invoke on the
#      same no-op worker directly (echo-upstream, pinned to CPU 1 with the
#      load tools); wrk for saturation, loadgen for open-loop latency;
#   2. in-place weight sync of a 100 MB checkpoint across 4 test-worker
#      replicas, all at once and one at a time, against one plain download
#      of the same file from the gateway and a raw read of it from disk;
#      and a cold sync again with workers that read the files where the
#      manifest says they lie (TEST_WORKER_WEIGHTS_LOCAL=1);
#   3. fairness: one tenant floods the queue, another sends single tasks;
#      the light tenant's wait with round-robin fairness against FIFO.
#
# Usage: benches/pools.sh   (env RATE, DURATION, CONNS, ROUNDS, SYNC_MB,
#                            FLOOD, LIGHT override; SMOKE=1 runs each part
#                            for a second or so, small, on the debug build,
#                            and fails on any error or missing figure)
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  RATE=${RATE:-200} DURATION=${DURATION:-1} CONNS=${CONNS:-8} ROUNDS=${ROUNDS:-1}
  SYNC_MB=${SYNC_MB:-4} FLOOD=${FLOOD:-200} LIGHT=${LIGHT:-5} PROFILE=${PROFILE:-debug}
fi

RATE=${RATE:-2000}
DURATION=${DURATION:-10}
CONNS=${CONNS:-64}
ROUNDS=${ROUNDS:-3}
SYNC_MB=${SYNC_MB:-100}
FLOOD=${FLOOD:-5000}
LIGHT=${LIGHT:-100}
PROFILE=${PROFILE:-release}
GW_CPU=${GW_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}

need() { command -v "$1" >/dev/null 2>&1; }
if ! need wrk || ! need taskset; then
  echo "installing wrk, util-linux from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq wrk util-linux >/dev/null
fi

if [ "$PROFILE" = release ]; then
  cargo build --release --workspace --bins -q
else
  cargo build --workspace --bins -q
fi
BIN=$PWD/target/$PROFILE
WORK=$(mktemp -d /tmp/warmgate-pools.XXXXXX)
# The control plane and /v1/weights need a credential: an admin token for
# the gateways this script starts, sent by its curls and by pool-fairness.
export WARMGATE_ADMIN_TOKEN="bench-$RANDOM$RANDOM"
OUT=${OUT:-$PWD/target/bench-results}
mkdir -p "$OUT"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT

start_gateway() { # config-file log [threads] -> sets GW_URL
  local cfg=$1 log=$2 threads=${3:-1}
  taskset -c "$GW_CPU" env WARMGATE_THREADS="$threads" WARMGATE_LOG=warn \
    "$BIN/warmgate" serve --config "$cfg" --listen 127.0.0.1:0 >"$log.out" 2>"$log" &
  PIDS+=($!)
  for _ in $(seq 1 500); do
    if grep -q "listening on" "$log.out" 2>/dev/null; then break; fi
    sleep 0.01
  done
  GW_URL=$(sed -n 's/^warmgate listening on //p' "$log.out" | head -1)
  [ -n "$GW_URL" ] || { cat "$log"; echo "warmgate did not start" >&2; exit 1; }
}
stop_gateway() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
ready_replicas() { # pool n -> prints the addresses once n are ready
  local pool=$1 n=$2
  for _ in $(seq 1 1500); do
    addrs=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$GW_URL/v1/status" | python3 -c '
import json,sys
p=[p for p in json.load(sys.stdin)["pools"] if p["name"]==sys.argv[1]][0]
r=[x["addr"] for x in p["pool"]["replicas"] if x["state"]=="ready"]
print(" ".join(r) if len(r)>=int(sys.argv[2]) else "")' "$pool" "$n" || true)
    [ -n "$addrs" ] && { echo "$addrs"; return; }
    sleep 0.02
  done
  echo "pool $pool did not get $n ready replicas" >&2; exit 1
}
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# --- 1. dispatch overhead ----------------------------------------------------
cat >"$WORK/noop.toml" <<EOF
state_dir = "$WORK/state-noop"
[[pools]]
name = "noop"
command = ["taskset", "-c", "$LOAD_CPU", "$BIN/echo-upstream"]
env = { TOKIO_WORKER_THREADS = "1" }
replicas = [1, 1]
concurrency = 100000
[pools.queue]
max_pending = 1000000
EOF
start_gateway "$WORK/noop.toml" "$WORK/gw-noop.log"
UP=$(ready_replicas noop 1)
declare -A URL=([direct]="http://$UP/invoke" [warmgate]="$GW_URL/v1/pools/noop/tasks")
declare -A BODY=([direct]='{}' [warmgate]='{"input": {}}')
for t in direct warmgate; do
  cat >"$WORK/$t.lua" <<EOF
wrk.method = "POST"
wrk.body = '${BODY[$t]}'
wrk.headers["Content-Type"] = "application/json"
EOF
  curl -sf -X POST -H 'content-type: application/json' -d "${BODY[$t]}" "${URL[$t]}" >/dev/null \
    || { echo "$t does not answer at ${URL[$t]}" >&2; exit 1; }
done
declare -A RPS_ALL P50_ALL P99_ALL ERR
for round in $(seq 1 "$ROUNDS"); do
  for t in direct warmgate; do
    out=$(taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNS" -d"${DURATION}s" -s "$WORK/$t.lua" "${URL[$t]}")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    non2xx=$(echo "$out" | awk '/Non-2xx/ {print $NF}')
    [ -z "$non2xx" ] || { echo "$t: $non2xx non-2xx answers under wrk" >&2; exit 1; }
    if [ "$SMOKE" = 1 ]; then
      # A refused or broken connection is an error; a slow answer (wrk's
      # timeout) on the debug build is not.
      sockerr=$(echo "$out" | awk '/Socket errors/ {gsub(",", ""); print $4 + $6 + $8}')
      [ -n "$rps" ] && [ "${sockerr:-0}" = 0 ] || { echo "$out" >&2; echo "$t: wrk failed" >&2; exit 1; }
    fi
    j=$(taskset -c "$LOAD_CPU" "$BIN/loadgen" --url "${URL[$t]}" --body "${BODY[$t]}" \
        --rate "$RATE" --duration "$DURATION" --connections "$CONNS" --label "$t")
    read -r p50 p99 err <<<"$(echo "$j" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["p50_ms"], d["p99_ms"], d["errors"])')"
    RPS_ALL[$t]+="$rps "; P50_ALL[$t]+="$p50 "; P99_ALL[$t]+="$p99 "
    ERR[$t]=$(( ${ERR[$t]:-0} + err ))
    echo "round $round $t: wrk $rps tasks/s; loadgen $j" >&2
  done
done
declare -A RPS P50 P99
for t in direct warmgate; do
  RPS[$t]=$(echo ${RPS_ALL[$t]} | tr ' ' '\n' | median)
  P50[$t]=$(echo ${P50_ALL[$t]} | tr ' ' '\n' | median)
  P99[$t]=$(echo ${P99_ALL[$t]} | tr ' ' '\n' | median)
done
stop_gateway

# --- 2. weight sync ----------------------------------------------------------
mkdir -p "$WORK/ckpt/v0" "$WORK/ckpt/v1" "$WORK/ckpt/v2"
echo '{}' >"$WORK/ckpt/v0/config.json"
head -c $((SYNC_MB * 1024 * 1024)) /dev/urandom >"$WORK/ckpt/v1/model.safetensors.bin"
head -c $((SYNC_MB * 1024 * 1024)) /dev/urandom >"$WORK/ckpt/v2/model.safetensors.bin"
cat >"$WORK/sync.toml" <<EOF
state_dir = "$WORK/state-sync"
[weights]
allowed_prefixes = ["file://$WORK/ckpt"]
[[pools]]
name = "sync"
command = ["$BIN/test-worker"]
# The bench calls the workers directly too: on their ports.
listen = "port"
env = { TEST_WORKER_WEIGHTS_NO_HASH = "1" }
checkpoint = "file://$WORK/ckpt/v0"
replicas = [4, 4]
EOF
GW_CPU=0-1 start_gateway "$WORK/sync.toml" "$WORK/gw-sync.log" 2
ready_replicas sync 4 >/dev/null
sync_to() { # version max_unavailable [checkpoint-dir] -> seconds (the API's own figure)
  curl -sf -X POST "$GW_URL/v1/pools/sync/weights" -H 'content-type: application/json' \
    -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" \
    -d "{\"checkpoint\": \"file://$WORK/ckpt/v${3:-$1}\", \"version\": $1, \"max_unavailable\": \"$2\"}" \
    | python3 -c 'import json,sys; d=json.load(sys.stdin); assert d["synced"]==4, d; print("%.3f" % d["seconds"])'
}
SYNC_ALL=$(sync_to 1 100%)
SYNC_ONE=$(sync_to 2 25%)
# Version 3 is v2's files again: the gateway's cache has them.
SYNC_WARM=$(sync_to 3 100% 2)
# Baselines: one plain download of the same (now cached) file from the
# gateway, four at once (as the four workers make), and a raw read from
# disk. The pool serves only its current version, v3 (v2's files).
downloads() { # how many at once -> seconds, the median of three
  python3 - "$GW_URL/v1/weights/sync/v3/model.safetensors.bin" "$1" <<'PY'
import os, sys, time, urllib.request
from concurrent.futures import ThreadPoolExecutor
def get(_):
    req = urllib.request.Request(sys.argv[1], headers={"authorization": "Bearer " + os.environ["WARMGATE_ADMIN_TOKEN"]})
    with urllib.request.urlopen(req) as r:
        while r.read(8 << 20):
            pass
n, runs = int(sys.argv[2]), []
for _ in range(3):
    t = time.perf_counter()
    with ThreadPoolExecutor(n) as ex:
        list(ex.map(get, range(n)))
    runs.append(time.perf_counter() - t)
print(f"{sorted(runs)[1]:.3f}")
PY
}
DL1=$(downloads 1)
DL=$(downloads 4)
RAW=$(python3 -c '
import sys,time
t=time.perf_counter()
with open(sys.argv[1],"rb") as f:
    while f.read(8<<20): pass
print(f"{time.perf_counter()-t:.3f}")' "$WORK/ckpt/v2/model.safetensors.bin")
stop_gateway

# The same cold sync with workers that read each file where the manifest
# says it lies on this machine (the Python kit's way on the local
# backend) instead of over HTTP: a fresh checkpoint, a fresh gateway.
mkdir -p "$WORK/ckpt/v4"
head -c $((SYNC_MB * 1024 * 1024)) /dev/urandom >"$WORK/ckpt/v4/model.safetensors.bin"
sed -e 's/TEST_WORKER_WEIGHTS_NO_HASH = "1"/TEST_WORKER_WEIGHTS_NO_HASH = "1", TEST_WORKER_WEIGHTS_LOCAL = "1"/' \
  -e "s#state-sync#state-sync-local#" "$WORK/sync.toml" >"$WORK/sync-local.toml"
grep -q TEST_WORKER_WEIGHTS_LOCAL "$WORK/sync-local.toml"
GW_CPU=0-1 start_gateway "$WORK/sync-local.toml" "$WORK/gw-sync-local.log" 2
ready_replicas sync 4 >/dev/null
SYNC_LOCAL=$(sync_to 1 100% 4)
stop_gateway

# --- 3. fairness -------------------------------------------------------------
fair_run() { # fairness flood light -> JSON line
  cat >"$WORK/fair-$1.toml" <<EOF
state_dir = "$WORK/state-fair-$1"
[[pools]]
name = "fair"
command = ["$BIN/test-worker"]
listen = "port"
replicas = [2, 2]
concurrency = 4
[pools.queue]
fairness = "$1"
EOF
  GW_CPU=0-1 start_gateway "$WORK/fair-$1.toml" "$WORK/gw-fair-$1.log" 2
  ready_replicas fair 2 >/dev/null
  "$BIN/pool-fairness" --gateway "$GW_URL" --pool fair --flood "$2" --light "$3" --label "$1"
  stop_gateway
}
FAIR=$(fair_run tenant "$FLOOD" "$LIGHT")
FIFO=$(fair_run none "$((FLOOD / 2))" 3)
echo "fairness: $FAIR" >&2
echo "fifo: $FIFO" >&2

# --- 4. report ---------------------------------------------------------------
python3 - "$OUT/pools.md" <<EOF
import json, sys
rps = {"direct": ${RPS[direct]}, "warmgate": ${RPS[warmgate]}}
p50 = {"direct": ${P50[direct]}, "warmgate": ${P50[warmgate]}}
p99 = {"direct": ${P99[direct]}, "warmgate": ${P99[warmgate]}}
err = {"direct": ${ERR[direct]}, "warmgate": ${ERR[warmgate]}}
fair = json.loads('''$FAIR''')
fifo = json.loads('''$FIFO''')
sync_all, sync_one, sync_warm, dl, dl1, raw = ${SYNC_ALL}, ${SYNC_ONE}, ${SYNC_WARM}, ${DL}, ${DL1}, ${RAW}
sync_local = ${SYNC_LOCAL}
lines = [
    f"## Task dispatch (median of ${ROUNDS} interleaved rounds; open loop ${RATE} tasks/s for ${DURATION}s over ${CONNS} connections; wrk -t1 -c${CONNS} for saturation; gateway on 1 core)",
    "",
    "| target | saturation tasks/s | p50 ms | p99 ms | errors (all rounds) |",
    "|---|---:|---:|---:|---:|",
]
for k in ("direct", "warmgate"):
    lines.append(f"| {k} | {rps[k]:.0f} | {p50[k]:.3f} | {p99[k]:.3f} | {err[k]} |")
lines += [
    "",
    f"- added per task: p50 {p50['warmgate'] - p50['direct']:.3f} ms (goal < 0.3), p99 {p99['warmgate'] - p99['direct']:.3f} ms",
    f"- tasks/s through one gateway core: {rps['warmgate']:.0f} (goal >= 20000); {rps['warmgate'] / rps['direct']:.2f}x of calling the worker directly",
    "",
    f"## Weight sync: ${SYNC_MB} MB checkpoint, 4 test-worker replicas",
    "",
    "| what | seconds | vs one plain download | vs 4 plain downloads at once |",
    "|---|---:|---:|---:|",
    f"| sync, all 4 at once (cold cache) | {sync_all:.3f} | {sync_all / dl1:.1f}x | {sync_all / dl:.1f}x |",
    f"| sync, one at a time (cold cache) | {sync_one:.3f} | {sync_one / dl1:.1f}x | {sync_one / dl:.1f}x |",
    f"| sync, all 4 at once (cached in the gateway) | {sync_warm:.3f} | {sync_warm / dl1:.1f}x | {sync_warm / dl:.1f}x |",
    f"| sync, all 4 at once (cold cache), workers reading the files where they lie | {sync_local:.3f} | {sync_local / dl1:.1f}x | {sync_local / dl:.1f}x |",
    f"| one plain download from the gateway (cached) | {dl1:.3f} | 1.0x | {dl1 / dl:.1f}x |",
    f"| 4 plain downloads at once from the gateway (cached) | {dl:.3f} | {dl / dl1:.1f}x | 1.0x |",
    f"| one raw read from disk | {raw:.3f} | {raw / dl1:.1f}x | {raw / dl:.1f}x |",
    "",
    f"- a cold sync to 4 replicas: {sync_all / dl1:.2f}x one plain download over HTTP (goal <= 1.5x); {sync_local / dl1:.2f}x with workers that read the files where they lie (a file:// store on the local backend)",
    "",
    "## Fairness: one tenant floods, one sends single tasks (2 replicas x 4 slots, 20 ms tasks)",
    "",
    "| queue | flood | light tasks | first light wait ms | light p50 wait ms | light p99 wait ms | backlog left |",
    "|---|---:|---:|---:|---:|---:|---:|",
]
for name, d in (("round-robin (fairness = tenant)", fair), ("FIFO (fairness = none)", fifo)):
    lines.append(f"| {name} | {d['flood']} | {d['light']} | {d['light_first_wait_ms']:.1f} | {d['light_wait_p50_ms']:.1f} | {d['light_wait_p99_ms']:.1f} | {d['bulk_backlog_at_end']} |")
lines += [
    "",
    "With FIFO the first light task waits behind the whole flood; the later ones",
    "find the queue empty, so only the first is comparable.",
]
text = "\n".join(lines) + "\n"
open(sys.argv[1], "w").write(text)
json.dump({
    "tasks_per_s": rps, "p50_ms": p50, "p99_ms": p99, "errors": err,
    "added_p50_ms": p50["warmgate"] - p50["direct"],
    "dispatch_vs_direct": rps["warmgate"] / rps["direct"],
    "sync_mb": ${SYNC_MB}, "sync_all_s": sync_all, "sync_one_s": sync_one,
    "sync_warm_s": sync_warm, "sync_all_local_s": sync_local,
    "sync_all_local_vs_one_download": sync_local / dl1, "one_download_s": dl1, "four_downloads_s": dl,
    "sync_all_vs_one_download": sync_all / dl1, "sync_all_vs_four_downloads": sync_all / dl,
    "fairness": fair, "fifo": fifo,
}, open(sys.argv[1].replace(".md", ".json"), "w"), indent=1)
print(text)
if ${SMOKE} == 1:
    # The smoke run's figures mean nothing; that it ran, and cleanly, does.
    assert not any(err.values()), f"tasks failed under loadgen: {err}"
    assert min(sync_all, sync_one, sync_warm, sync_local, dl, dl1) > 0, "a weight sync or download has no time"
    for name, d, flood, light in (("fairness", fair, ${FLOOD}, ${LIGHT}), ("fifo", fifo, ${FLOOD} // 2, 3)):
        assert d["flood"] == flood and d["light"] == light, f"{name}: {d}"
        assert d["light_wait_p99_ms"] > 0, f"{name}: no light task's wait: {d}"
EOF
