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
# Real vLLM (ROUTING_ENGINE=vllm): the engines are real vLLM 0.32 (the CPU
# build `make vllm` installs) serving the tiny Llama of
# tests/vllm/make_model.py, 2 of them, on ports (an outside router needs a
# URL), with their prefix caching and VLLM_SERVER_DEV_MODE=1 (for
# /reset_prefix_cache), each with a KV cache of VLLM_BLOCKS (160) blocks of
# 32 tokens (the CPU build's smallest), about half of what the groups'
# prompts take; the workload is `prefix` sized for this CPU (16 groups of a
# 150-word system prompt and a 20-word question, 3 requests/s, 90 s, 8
# output tokens), after 20 s of warm-up not counted; the targets
# warmgate-prefix, direct-rr (round
# robin) and sglang-router: SGLang's router (`sglang-router` from PyPI,
# its cache_aware policy, installed into ~/.cache/warmgate on first use)
# on the first gateway's engines, after it, as the direct targets are.
#
# Usage: benches/routing.sh
#   env ROUTING_TARGETS   (warmgate-prefix,warmgate-least_loaded,direct-hash,direct-rr)
#       ROUTING_WORKLOADS (prefix,chat,skew,unique)
#       ROUTING_DURATION (20 s per phase), ROUTING_DRAIN (20), ROUTING_RATE (50),
#       ROUTING_CHAT_RATE (110), ROUTING_THINK_S (0.5), ROUTING_MAX_TOKENS (16),
#       ROUTING_SEED (1), LOAD_BOUND (1.25), ENGINES (4),
#       ROUTING_CONCURRENCY (64: each replica's limit in warmgate),
#       STANDIN_SLOTS (4), STANDIN_PREFILL_MS_PER_TOKEN (0.15),
#       STANDIN_DECODE_MS_PER_TOKEN (4), STANDIN_CACHE_TOKENS (64000),
#       STANDIN_BLOCK_TOKENS (16), WARMGATE_BIN (default: cargo build --release)
# The baselines alone need no build: ROUTING_TARGETS=direct-hash,direct-rr
#   SMOKE=1: the stand-in engines only, 2 of them, every workload for a
#       second at small sizes (4 groups of 200 words), warmgate the debug
#       build; SGLang's router too when it is already installed (never
#       installed by a smoke run: said on stderr); fails unless every
#       target × workload answered every request it sent.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

ENGINE=${ROUTING_ENGINE:-standin}
SMOKE=${SMOKE:-0}
SGLANG_VENV=$HOME/.cache/warmgate/sglang-router-venv
sglang_installed() { [ -x "$SGLANG_VENV/bin/python" ] && "$SGLANG_VENV/bin/python" -c 'import sglang_router' 2>/dev/null; }
if [ "$SMOKE" = 1 ]; then
  [ "$ENGINE" = standin ] || { echo "SMOKE=1 runs the stand-in engines only" >&2; exit 64; }
  export ROUTING_DURATION=${ROUTING_DURATION:-1} ROUTING_DRAIN=${ROUTING_DRAIN:-30}
  export ROUTING_RATE=${ROUTING_RATE:-20} ROUTING_CHAT_RATE=${ROUTING_CHAT_RATE:-30}
  export ROUTING_THINK_S=${ROUTING_THINK_S:-0.05} ROUTING_MAX_TOKENS=${ROUTING_MAX_TOKENS:-4}
  export ROUTING_GROUPS=${ROUTING_GROUPS:-4} ROUTING_SYSTEM_WORDS=${ROUTING_SYSTEM_WORDS:-200}
  export ROUTING_QUESTION_WORDS=${ROUTING_QUESTION_WORDS:-20} ROUTING_UNIQUE_WORDS=${ROUTING_UNIQUE_WORDS:-100}
  ENGINES=${ENGINES:-2}
  ROUTING_TARGETS=${ROUTING_TARGETS:-warmgate-prefix,warmgate-least_loaded,direct-hash,direct-rr,sglang-router}
  if [[ ",$ROUTING_TARGETS," == *",sglang-router,"* ]] && ! sglang_installed; then
    echo "routing smoke: SGLang's router is not installed ($SGLANG_VENV; a full run with" \
      "ROUTING_TARGETS=...,sglang-router installs it from PyPI): running warmgate's and the direct targets only" >&2
    ROUTING_TARGETS=$(echo ",$ROUTING_TARGETS," | sed 's/,sglang-router,/,/; s/^,//; s/,$//')
  fi
  if [ -z "${WARMGATE_BIN:-}" ] && [[ ",$ROUTING_TARGETS," == *",warmgate-"* ]]; then
    cargo build --workspace --bins -q
    WARMGATE_BIN=$ROOT/target/debug/warmgate
  fi
fi
LOAD_BOUND=${LOAD_BOUND:-1.25}
PYTHON=$(python3 -c 'import sys; print(sys.executable)')
if [ "$ENGINE" = vllm ]; then
  TARGETS=${ROUTING_TARGETS:-warmgate-prefix,direct-rr,sglang-router}
  WORKLOADS=${ROUTING_WORKLOADS:-prefix}
  ENGINES=${ENGINES:-2}
  MODEL=tiny
  VLLM_VENV=${WARMGATE_VLLM_VENV:-$HOME/.cache/warmgate/vllm-0.32.0}
  # A cache that holds about half the groups' prompts: where a request
  # goes decides whether its prefix is still there.
  VLLM_BLOCKS=${VLLM_BLOCKS:-160}
  [ -x "$VLLM_VENV/bin/vllm" ] || { echo "real vLLM is not installed: make vllm" >&2; exit 1; }
  "$VLLM_VENV/bin/python" tests/vllm/make_model.py target/tmp/vllm-tiny-llama >/dev/null
  export ROUTING_GROUPS=${ROUTING_GROUPS:-16} ROUTING_SYSTEM_WORDS=${ROUTING_SYSTEM_WORDS:-150}
  export ROUTING_QUESTION_WORDS=${ROUTING_QUESTION_WORDS:-20} ROUTING_RATE=${ROUTING_RATE:-3}
  export ROUTING_DURATION=${ROUTING_DURATION:-90} ROUTING_DRAIN=${ROUTING_DRAIN:-60}
  export ROUTING_MAX_TOKENS=${ROUTING_MAX_TOKENS:-8}
  export ROUTING_ENGINES_SAID="$ENGINES engines (real vLLM 0.32, CPU, the tiny Llama, $VLLM_BLOCKS blocks of 32 tokens of KV cache each)"
elif [ "$ENGINE" = standin ]; then
  TARGETS=${ROUTING_TARGETS:-warmgate-prefix,warmgate-least_loaded,direct-hash,direct-rr}
  WORKLOADS=${ROUTING_WORKLOADS:-prefix,chat,skew,unique}
  ENGINES=${ENGINES:-4}
  MODEL=llm
else
  echo "ROUTING_ENGINE is standin or vllm, not '$ENGINE'" >&2; exit 64
fi
ENGINE_ARGS=(
  --slots "${STANDIN_SLOTS:-4}"
  --prefill-ms-per-token "${STANDIN_PREFILL_MS_PER_TOKEN:-0.15}"
  --decode-ms-per-token "${STANDIN_DECODE_MS_PER_TOKEN:-4}"
  --cache-tokens "${STANDIN_CACHE_TOKENS:-64000}"
  --block-tokens "${STANDIN_BLOCK_TOKENS:-16}"
)

for t in ${TARGETS//,/ }; do
  case $t in
    warmgate-prefix|warmgate-session|warmgate-least_loaded|warmgate-default|direct-hash|direct-rr|sglang-router) ;;
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
    if [ "$t" = sglang-router ]; then
      run_sglang_router "$1"
      continue
    fi
    "$PYTHON" benches/routing_load.py run --target "$t" --mode "${t#direct-}" --engines "$1" \
      --model "$MODEL" --workloads "$WORKLOADS" --out "$RAW"
  done
}
# SGLang's router (PyPI `sglang-router`), cache_aware, in front of the engines.
run_sglang_router() { # engine-urls
  local venv=$SGLANG_VENV port log=$WORK/sglang-router.log pid
  if ! sglang_installed; then
    python3 -m venv "$venv" && "$venv/bin/pip" install -q sglang-router
  fi
  port=$(free_port)
  # shellcheck disable=SC2086
  "$venv/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port "$port" \
    --policy cache_aware --worker-urls ${1//,/ } >"$log" 2>&1 &
  pid=$!
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; echo "sglang-router exited" >&2; exit 1; }
    sleep 0.1
  done
  "$PYTHON" benches/routing_load.py run --target sglang-router --mode gateway \
    --url "http://127.0.0.1:$port" --engines "$1" --model "$MODEL" --workloads "$WORKLOADS" --out "$RAW"
  kill -TERM "$pid" 2>/dev/null || true
  wait "$pid" 2>/dev/null || true
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
EOF
    if [ "$ENGINE" = vllm ]; then
      cat <<EOF
command = ["$VLLM_VENV/bin/vllm", "serve", "$ROOT/target/tmp/vllm-tiny-llama", "--served-model-name", "$MODEL",
           "--port", "\$PORT", "--max-model-len", "2048", "--enable-prefix-caching",
           "--enable-prompt-tokens-details", "--block-size", "32",
           "--num-gpu-blocks-override", "$VLLM_BLOCKS"]
env = { VLLM_SERVER_DEV_MODE = "1", VLLM_CPU_KVCACHE_SPACE = "1", VLLM_CPU_OMP_THREADS_BIND = "nobind", HF_HUB_OFFLINE = "1", VLLM_TARGET_DEVICE = "cpu" }
# On ports: SGLang's router reaches the same engines by URL.
listen = "port"
startup_timeout = "600s"
EOF
    else
      cat <<EOF
command = ["$PYTHON", "$ROOT/tests/standins/llm_engine.py", "--port", "\$PORT", "--model", "$MODEL",
           $(printf '"%s", ' "${ENGINE_ARGS[@]}" | sed 's/, $//')]
startup_timeout = "60s"
EOF
    fi
    cat <<EOF
# An engine batches: the gateway sends on, the engine's own queue holds.
concurrency = ${ROUTING_CONCURRENCY:-64}

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
  local addrs="" deadline=$(( $(date +%s) + 600 ))
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
  if [ "$ENGINE" = vllm ] && [ "$3" = with-direct ]; then
    # A real engine's first requests pay its warm-up (kernels for new
    # shapes): 20 s of round robin, not counted, before any target.
    ROUTING_DURATION=20 "$PYTHON" benches/routing_load.py run --target warm-up --mode rr \
      --engines "$addrs" --model "$MODEL" --workloads "$WORKLOADS" --out "$WORK/warm-up.json" >/dev/null
  fi
  "$PYTHON" benches/routing_load.py run --target "$target" --mode gateway --url "$gw" \
    --engines "$addrs" --model "$MODEL" --workloads "$WORKLOADS" --out "$RAW"
  # The direct targets on the very replicas this gateway started (idle now).
  [ "$3" = with-direct ] && run_direct "$addrs"
  stop_all
}

START=$(date +%s)
if [ ${#GATEWAYS[@]} -eq 0 ]; then
  if [ "$ENGINE" = vllm ]; then
    echo "with real vLLM a warmgate target comes first: its gateway starts the engines" >&2
    exit 64
  fi
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
if [ "$SMOKE" = 1 ]; then
  # The smoke run's figures mean nothing; that every target ran every
  # workload, and every request it sent was answered, does.
  python3 - "$OUT/routing.json" "$TARGETS" "$WORKLOADS" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1]))["results"]
by = {(r["target"], r["workload"]): r for r in rows}
bad = []
for t in sys.argv[2].split(","):
    for w in sys.argv[3].split(","):
        r = by.get((t, w))
        if r is None:
            bad.append(f"{t}/{w}: no result")
        elif r["sent"] == 0 or r["errors"] or r["ok"] != r["sent"]:
            bad.append(f"{t}/{w}: {r['ok']} of {r['sent']} answered, errors {r['error_kinds']}")
        elif not r["prompt_tokens"] or r["ttft_ms"]["p50"] is None:
            bad.append(f"{t}/{w}: no usage or no first token")
        elif not r["engines_idle_after"]:
            bad.append(f"{t}/{w}: the engines were still busy after the phase")
assert not bad, "routing smoke: " + "; ".join(bad)
print(f"routing smoke: ok ({len(by)} target × workload phases)", file=sys.stderr)
PY
fi
