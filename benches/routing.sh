#!/usr/bin/env bash
# LLM-aware routing, measured against baselines in the same run, on loopback:
#
#   engines  = 4 replicas of tests/standins/llm_engine.py, a stand-in vLLM
#              (slots, a FIFO wait queue, a block prefix cache with LRU,
#              prefill time per uncached token, vLLM's usage and /metrics)
#   targets  = warmgate-prefix         warmgate, [apps.routing] policy = "prefix"
#              warmgate-least_loaded   warmgate, policy = "least_loaded" (the old way)
#              direct-hash             no gateway: the client sends each prefix
#                                      group / session to one engine by hash
#              direct-rr               no gateway: the client goes round robin
#              (also: warmgate-session, and warmgate-default: an app with no
#              [apps.routing] nor [apps.engine] table, warmgate's defaults)
#   load     = benches/routing_load.py: 4 workloads, streamed chat completions
#              with usage: prefix (64 groups × 2,048-word system prompt +
#              256-word question, Poisson 50/s), chat (6-turn sessions, ~110
#              turns/s, X-Session-Id and `user`), skew (as prefix, one group
#              has half the traffic), unique (nothing shared)
#
# Every target × workload starts from idle engines with empty prefix caches
# (POST /reset_prefix_cache on each engine, vLLM's dev-mode path), and gets
# the same requests at the same times (seeded). Each gateway target runs on
# the 4 replicas its warmgate starts (one gateway at a time); the direct
# targets run on the very replicas of the first gateway, after it, while it
# is idle (or, with no gateway target, on 4 engines this script starts with
# the same command and flags).
#
# Reported per target × workload: cached-token ratio (sum of
# usage.prompt_tokens_details.cached_tokens / sum of prompt_tokens), TTFT
# p50/p90/p99 (scheduled send to first content chunk), throughput, errors,
# requests per engine; and ratios against the baselines. Table on stdout and
# in target/bench-results/routing.md, everything in routing.json.
#
# Usage: benches/routing.sh
#   env ROUTING_TARGETS   (warmgate-prefix,warmgate-least_loaded,direct-hash,direct-rr)
#       ROUTING_WORKLOADS (prefix,chat,skew,unique)
#       ROUTING_DURATION (20 s per phase), ROUTING_DRAIN (20), ROUTING_RATE (50),
#       ROUTING_CHAT_RATE (110), ROUTING_THINK_S (0.5), ROUTING_MAX_TOKENS (16),
#       ROUTING_SEED (1), LOAD_BOUND (1.25), ENGINES (4),
#       STANDIN_SLOTS (4), STANDIN_PREFILL_MS_PER_TOKEN (0.15),
#       STANDIN_DECODE_MS_PER_TOKEN (4), STANDIN_CACHE_TOKENS (64000),
#       STANDIN_BLOCK_TOKENS (16), WARMGATE_BIN (default: cargo build --release)
# The baselines alone need no build: ROUTING_TARGETS=direct-hash,direct-rr
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TARGETS=${ROUTING_TARGETS:-warmgate-prefix,warmgate-least_loaded,direct-hash,direct-rr}
WORKLOADS=${ROUTING_WORKLOADS:-prefix,chat,skew,unique}
ENGINES=${ENGINES:-4}
LOAD_BOUND=${LOAD_BOUND:-1.25}
MODEL=llm
PYTHON=$(python3 -c 'import sys; print(sys.executable)')
ENGINE_ARGS=(
  --slots "${STANDIN_SLOTS:-4}"
  --prefill-ms-per-token "${STANDIN_PREFILL_MS_PER_TOKEN:-0.15}"
  --decode-ms-per-token "${STANDIN_DECODE_MS_PER_TOKEN:-4}"
  --cache-tokens "${STANDIN_CACHE_TOKENS:-64000}"
  --block-tokens "${STANDIN_BLOCK_TOKENS:-16}"
)

for t in ${TARGETS//,/ }; do
  case $t in
    warmgate-prefix|warmgate-session|warmgate-least_loaded|warmgate-default|direct-hash|direct-rr) ;;
    *) echo "unknown target '$t'" >&2; exit 64 ;;
  esac
done

BIN=""
if [[ ",$TARGETS," == *",warmgate-"* ]]; then
  if [ -n "${WARMGATE_BIN:-}" ]; then
    BIN=$WARMGATE_BIN
  else
    cargo build --release --bin warmgate -q
    BIN=$ROOT/target/release/warmgate
  fi
fi

WORK=$(mktemp -d /tmp/warmgate-routing.XXXXXX)
# The control plane (/v1/status, to find the replicas) needs a credential:
# an admin token for the gateways this script starts.
export WARMGATE_ADMIN_TOKEN="bench-$RANDOM$RANDOM"
OUT=${OUT:-$ROOT/target/bench-results}
mkdir -p "$OUT"
RAW=$WORK/results.json
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
stop_all() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_health() { # url
  for _ in $(seq 1 500); do
    curl -sf "$1/health" >/dev/null 2>&1 && return 0
    sleep 0.02
  done
  echo "no answer from $1/health" >&2; exit 1
}

# --- direct targets: the client picks the engine ---------------------------------
DIRECT=() GATEWAYS=()
for t in ${TARGETS//,/ }; do
  case $t in warmgate-*) GATEWAYS+=("$t") ;; *) DIRECT+=("$t") ;; esac
done
run_direct() { # engine-urls (comma separated): every direct target on these engines
  local t
  for t in "${DIRECT[@]}"; do
    "$PYTHON" benches/routing_load.py run --target "$t" --mode "${t#direct-}" --engines "$1" \
      --model "$MODEL" --workloads "$WORKLOADS" --out "$RAW"
  done
}
start_engines() { # -> sets ENGINE_URLS: engines started by this script
  local urls=() i port
  for i in $(seq 1 "$ENGINES"); do
    port=$(free_port)
    "$PYTHON" tests/standins/llm_engine.py --port "$port" --model "$MODEL" "${ENGINE_ARGS[@]}" \
      >"$WORK/engine-$i.log" 2>&1 &
    PIDS+=($!)
    urls+=("http://127.0.0.1:$port")
  done
  for u in "${urls[@]}"; do wait_health "$u"; done
  ENGINE_URLS=$(IFS=,; echo "${urls[*]}")
}

# --- gateway targets: warmgate starts the engines as its app's replicas ---------
run_gateway() { # target policy with-direct
  local target=$1 policy=$2 cfg=$WORK/$1.toml
  {
    cat <<EOF
state_dir = "$WORK/state-$target"

[[apps]]
name = "$MODEL"
command = ["$PYTHON", "$ROOT/tests/standins/llm_engine.py", "--port", "\$PORT", "--model", "$MODEL",
           $(printf '"%s", ' "${ENGINE_ARGS[@]}" | sed 's/, $//')]
# An engine batches: the gateway sends on, the engine's own queue holds.
concurrency = 64
startup_timeout = "60s"

[apps.health]
path = "/health"

[apps.autoscale]
min = $ENGINES
max = $ENGINES

[apps.queue]
max_pending = 100000
timeout = "120s"
EOF
    if [ "$policy" != default ]; then
      cat <<EOF

[apps.routing]
policy = "$policy"
load_bound = $LOAD_BOUND

[apps.engine]
metrics_path = "/metrics"
EOF
    fi
  } >"$cfg"
  if ! "$BIN" serve --config "$cfg" --check >"$WORK/$target.check" 2>&1; then
    cat "$WORK/$target.check" >&2
    echo "warmgate refuses the config of $target (above; $cfg):" >&2
    sed 's/^/    /' "$cfg" >&2
    echo "run the baselines alone with ROUTING_TARGETS=direct-hash,direct-rr" >&2
    exit 1
  fi
  local log=$WORK/gw-$target.log
  env WARMGATE_LOG=warn "$BIN" serve --config "$cfg" --listen 127.0.0.1:0 >"$log.out" 2>"$log" &
  PIDS+=($!)
  for _ in $(seq 1 500); do
    grep -q "listening on" "$log.out" 2>/dev/null && break
    sleep 0.01
  done
  local gw; gw=$(sed -n 's/^warmgate listening on //p' "$log.out" | head -1)
  [ -n "$gw" ] || { cat "$log"; echo "warmgate did not start" >&2; exit 1; }
  local addrs="" deadline=$(( $(date +%s) + 120 ))
  while [ "$(date +%s)" -lt "$deadline" ]; do
    addrs=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$gw/v1/status" | python3 -c '
import json,sys
a=[a for a in json.load(sys.stdin)["apps"] if a["name"]==sys.argv[1]][0]
r=["http://"+x["addr"] for x in a["pool"]["replicas"] if x["state"]=="ready" and x["addr"]]
print(",".join(r) if len(r)>=int(sys.argv[2]) else "")' "$MODEL" "$ENGINES" 2>/dev/null || true)
    [ -n "$addrs" ] && break
    sleep 0.1
  done
  [ -n "$addrs" ] || { cat "$log"; echo "$target: $ENGINES replicas did not become ready" >&2; exit 1; }
  "$PYTHON" benches/routing_load.py run --target "$target" --mode gateway --url "$gw" \
    --engines "$addrs" --model "$MODEL" --workloads "$WORKLOADS" --out "$RAW"
  # The direct targets on the very replicas this gateway started (idle now).
  [ "$3" = with-direct ] && run_direct "$addrs"
  stop_all
}

START=$(date +%s)
if [ ${#GATEWAYS[@]} -eq 0 ]; then
  start_engines
  run_direct "$ENGINE_URLS"
  stop_all
else
  first=with-direct
  for t in "${GATEWAYS[@]}"; do
    run_gateway "$t" "${t#warmgate-}" "$first"
    first=""
  done
fi
"$PYTHON" benches/routing_load.py report "$RAW" --order "$TARGETS" \
  --json "$OUT/routing.json" --md "$OUT/routing.md"
echo "($(( $(date +%s) - START )) s; $OUT/routing.json)" >&2
