#!/usr/bin/env bash
# Proxy overhead of warmgate against nginx, and the gateway's share of a cold
# start. Everything runs in one go on loopback:
#
#   upstream  = echo-upstream (hyper), started by warmgate as an app replica,
#               so nginx and warmgate proxy to the very same process
#   proxies   = nginx (Debian, 1 worker, upstream keep-alive) and warmgate
#               (1 tokio worker thread), both pinned to CPU 0
#   load      = wrk (saturation, closed loop) and loadgen (fixed open-loop
#               rate, latency from the scheduled send time), pinned to CPU 1
#               together with the upstream
#
# A second table streams chat answers as vLLM does (16 one-token events,
# the usage chunk when asked): direct, nginx, and warmgate on the same
# request routed by its `model` twice, on `/v1/chat/completions` (tokens
# counted: the gateway asks for the usage chunk, reads every frame for it,
# takes it out and adds it to the ledger) and on `/v1/moderations` (the same
# path through the gateway, nothing counted). The cost of counting is the
# difference of the two, per round.
#
# Usage: benches/proxy.sh   (env RATE, STREAM_RATE, DURATION, CONNS, ROUNDS,
#                            COLD_N override; SMOKE=1 runs each part for a
#                            second on the debug build and fails on any error)
set -euo pipefail
# The control plane (status, read below) needs the admin token: the bench
# gives the gateway its own.
export WARMGATE_ADMIN_TOKEN="bench-$RANDOM$RANDOM"
cd "$(dirname "$0")/.."

SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
  RATE=${RATE:-200} STREAM_RATE=${STREAM_RATE:-100} DURATION=${DURATION:-1}
  CONNS=${CONNS:-8} COLD_N=${COLD_N:-2} ROUNDS=${ROUNDS:-1} PROFILE=${PROFILE:-debug}
fi
RATE=${RATE:-5000}
STREAM_RATE=${STREAM_RATE:-1000}
DURATION=${DURATION:-10}
CONNS=${CONNS:-64}
COLD_N=${COLD_N:-30}
ROUNDS=${ROUNDS:-3}
PROFILE=${PROFILE:-release}
PROXY_CPU=${PROXY_CPU:-0}
LOAD_CPU=${LOAD_CPU:-1}

need() { command -v "$1" >/dev/null 2>&1; }
if ! need nginx || ! need wrk || ! need taskset; then
  echo "installing nginx, wrk, util-linux from Debian" >&2
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq && apt-get install -y -qq nginx-light wrk util-linux >/dev/null
fi

if [ "$PROFILE" = release ]; then
  cargo build --release --workspace --bins -q
else
  cargo build --workspace --bins -q
fi
BIN=$PWD/target/$PROFILE
WORK=$(mktemp -d /tmp/warmgate-bench.XXXXXX)
OUT=${OUT:-$PWD/target/bench-results}
mkdir -p "$OUT"
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  [ -f "$WORK/nginx/nginx.pid" ] && kill -QUIT "$(cat "$WORK/nginx/nginx.pid")" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

start_gateway() { # config-file -> sets GW_URL
  local cfg=$1 log=$2
  taskset -c "$PROXY_CPU" env WARMGATE_THREADS=1 WARMGATE_LOG=warn \
    "$BIN/warmgate" serve --config "$cfg" --listen 127.0.0.1:0 >"$log.out" 2>"$log" &
  PIDS+=($!)
  for _ in $(seq 1 500); do
    if grep -q "listening on" "$log.out" 2>/dev/null; then break; fi
    sleep 0.01
  done
  GW_URL=$(sed -n 's/^warmgate listening on //p' "$log.out" | head -1)
  [ -n "$GW_URL" ] || { cat "$log"; echo "warmgate did not start" >&2; exit 1; }
}

# --- 1. warmgate with the upstream as its replica ---------------------------
cat >"$WORK/proxy.toml" <<EOF
state_dir = "$WORK/state"
[[apps]]
name = "echo"
command = ["taskset", "-c", "$LOAD_CPU", "$BIN/echo-upstream"]
env = { TOKIO_WORKER_THREADS = "1" }
concurrency = 100000
[apps.autoscale]
min = 1
max = 1
[apps.queue]
max_pending = 100000
# Both streamed paths are routed alike (prefix routing reads chat prompts
# only, and benches/src/bin/route-cost.rs times it): what differs between
# them is the counting.
[apps.routing]
policy = "least_loaded"
EOF
start_gateway "$WORK/proxy.toml" "$WORK/gw.log"
UPSTREAM=""
for _ in $(seq 1 500); do
  UPSTREAM=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$GW_URL/v1/status" | python3 -c '
import json,sys
a=json.load(sys.stdin)["apps"][0]
r=[x for x in a["pool"]["replicas"] if x["state"]=="ready"]
print(r[0]["addr"] if r else "")' || true)
  [ -n "$UPSTREAM" ] && break
  sleep 0.02
done
[ -n "$UPSTREAM" ] || { echo "the upstream replica did not become ready" >&2; exit 1; }

# --- 2. nginx in front of the same upstream ----------------------------------
NGINX_PORT=$(free_port)
mkdir -p "$WORK/nginx/logs"
cat >"$WORK/nginx/nginx.conf" <<EOF
worker_processes 1;
daemon on;
pid $WORK/nginx/nginx.pid;
error_log $WORK/nginx/logs/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $WORK/nginx/body;
  proxy_temp_path $WORK/nginx/proxy;
  fastcgi_temp_path $WORK/nginx/fcgi;
  uwsgi_temp_path $WORK/nginx/uwsgi;
  scgi_temp_path $WORK/nginx/scgi;
  upstream up { server $UPSTREAM; keepalive 256; }
  server {
    listen 127.0.0.1:$NGINX_PORT;
    keepalive_requests 1000000;
    location /apps/echo/ {
      proxy_pass http://up/;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
    }
  }
}
EOF
taskset -c "$PROXY_CPU" nginx -p "$WORK/nginx" -c "$WORK/nginx/nginx.conf"
for _ in $(seq 1 200); do curl -sf "http://127.0.0.1:$NGINX_PORT/apps/echo/" >/dev/null && break; sleep 0.02; done

declare -A URL=(
  [direct]="http://$UPSTREAM/"
  [nginx]="http://127.0.0.1:$NGINX_PORT/apps/echo/"
  [warmgate]="$GW_URL/apps/echo/"
)
for t in direct nginx warmgate; do
  curl -sf "${URL[$t]}" >/dev/null || { echo "$t does not answer at ${URL[$t]}" >&2; exit 1; }
done

# --- 3. saturation (wrk) and fixed-rate latency (loadgen) ---------------------
# ROUNDS rounds, targets interleaved within each round so that drift in the
# machine's load hits all three alike; the report takes the median round.
median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
declare -A RPS_ALL P50_ALL P99_ALL P999_ALL ERR
for round in $(seq 1 "$ROUNDS"); do
  for t in direct nginx warmgate; do
    out=$(taskset -c "$LOAD_CPU" wrk -t1 -c"$CONNS" -d"${DURATION}s" "${URL[$t]}")
    rps=$(echo "$out" | awk '/Requests\/sec/ {print $2}')
    j=$(taskset -c "$LOAD_CPU" "$BIN/loadgen" --url "${URL[$t]}" --rate "$RATE" \
        --duration "$DURATION" --connections "$CONNS" --label "$t")
    read -r p50 p99 p999 err <<<"$(echo "$j" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["p50_ms"], d["p99_ms"], d["p999_ms"], d["errors"])')"
    RPS_ALL[$t]+="$rps "; P50_ALL[$t]+="$p50 "; P99_ALL[$t]+="$p99 "; P999_ALL[$t]+="$p999 "
    ERR[$t]=$(( ${ERR[$t]:-0} + err ))
    echo "round $round $t: wrk $rps req/s; loadgen $j" >&2
  done
done
declare -A RPS P50 P99 P999
for t in direct nginx warmgate; do
  RPS[$t]=$(echo ${RPS_ALL[$t]} | tr ' ' '\n' | median)
  P50[$t]=$(echo ${P50_ALL[$t]} | tr ' ' '\n' | median)
  P99[$t]=$(echo ${P99_ALL[$t]} | tr ' ' '\n' | median)
  P999[$t]=$(echo ${P999_ALL[$t]} | tr ' ' '\n' | median)
done
# --- 3b. streamed chat answers: the cost of counting tokens -------------------
CHAT_BODY=$(python3 -c '
import json
print(json.dumps({"model": "echo", "stream": True, "max_tokens": 16, "messages": [
  {"role": "system", "content": "You are a helpful assistant. " * 100},
  {"role": "user", "content": "what is a gateway?"}]}, separators=(",", ":")))')
declare -A SURL=(
  [direct]="http://$UPSTREAM/v1/chat/completions"
  [nginx]="http://127.0.0.1:$NGINX_PORT/apps/echo/v1/chat/completions"
  [passed]="$GW_URL/v1/moderations"
  [counted]="$GW_URL/v1/chat/completions"
)
STARGETS="direct nginx passed counted"
for t in $STARGETS; do
  n=$(curl -sf -X POST -H 'content-type: application/json' -d "$CHAT_BODY" "${SURL[$t]}" | grep -c '^data: ') \
    || { echo "$t does not stream at ${SURL[$t]}" >&2; exit 1; }
  echo "$t streams $n events" >&2
done
declare -A SP50_ALL SP99_ALL SERR
COST_ALL=""
for round in $(seq 1 "$ROUNDS"); do
  declare -A this
  for t in $STARGETS; do
    j=$(taskset -c "$LOAD_CPU" "$BIN/loadgen" --url "${SURL[$t]}" --rate "$STREAM_RATE" \
        --duration "$DURATION" --connections "$CONNS" --label "stream-$t" --body "$CHAT_BODY")
    read -r p50 p99 err <<<"$(echo "$j" | python3 -c 'import json,sys; d=json.load(sys.stdin); print(d["p50_ms"], d["p99_ms"], d["errors"])')"
    SP50_ALL[$t]+="$p50 "; SP99_ALL[$t]+="$p99 "; this[$t]=$p50
    SERR[$t]=$(( ${SERR[$t]:-0} + err ))
    echo "round $round stream $t: $j" >&2
  done
  COST_ALL+="$(python3 -c "print(round((${this[counted]} - ${this[passed]}) * 1000, 1))") "
done
declare -A SP50 SP99
for t in $STARGETS; do
  SP50[$t]=$(echo ${SP50_ALL[$t]} | tr ' ' '\n' | median)
  SP99[$t]=$(echo ${SP99_ALL[$t]} | tr ' ' '\n' | median)
done
COST=$(echo $COST_ALL | tr ' ' '\n' | median)
TOKENS=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$GW_URL/metrics" | awk '/^warmgate_tokens_total/ {s += $NF} END {print s + 0}')
kill -TERM "${PIDS[0]}"; wait "${PIDS[0]}" 2>/dev/null || true; PIDS=()
kill -QUIT "$(cat "$WORK/nginx/nginx.pid")" 2>/dev/null || true

# --- 4. the gateway's share of cold starts ------------------------------------
{
  echo "state_dir = \"$WORK/state-cold\""
  for i in $(seq 1 "$COLD_N"); do
    cat <<EOF
[[apps]]
name = "cold$i"
command = ["$BIN/echo-upstream"]
env = { TOKIO_WORKER_THREADS = "1" }
EOF
  done
} >"$WORK/cold.toml"
start_gateway "$WORK/cold.toml" "$WORK/gw-cold.log"
TOTALS=()
for i in $(seq 1 "$COLD_N"); do
  TOTALS+=("$(curl -s -o /dev/null -w '%{time_total}' "$GW_URL/apps/cold$i/")")
done
COLD=$(curl -s -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "$GW_URL/v1/status" | python3 -c '
import json,sys,statistics
apps=json.load(sys.stdin)["apps"]
h=sorted(a["handoff_ms"] for a in apps if a["handoff_ms"] is not None)
r=sorted(a["pool"]["last_cold_start"]["ready_seconds"]*1e3 for a in apps if a["pool"]["last_cold_start"])
q=lambda v,p: v[min(len(v)-1,int(p*len(v)))]
print(f"{len(h)} {q(h,.5):.3f} {q(h,.9):.3f} {h[-1]:.3f} {q(r,.5):.1f}")')
read -r COLD_COUNT HO_P50 HO_P90 HO_MAX READY_P50 <<<"$COLD"
TOTAL_P50=$(printf '%s\n' "${TOTALS[@]}" | sort -n | awk '{a[NR]=$1} END {printf "%.1f", a[int((NR+1)/2)]*1000}')

# --- 5. report ----------------------------------------------------------------
python3 - "$OUT/proxy.md" <<EOF
import sys
rps = {"direct": ${RPS[direct]}, "nginx": ${RPS[nginx]}, "warmgate": ${RPS[warmgate]}}
p50 = {"direct": ${P50[direct]}, "nginx": ${P50[nginx]}, "warmgate": ${P50[warmgate]}}
p99 = {"direct": ${P99[direct]}, "nginx": ${P99[nginx]}, "warmgate": ${P99[warmgate]}}
p999 = {"direct": ${P999[direct]}, "nginx": ${P999[nginx]}, "warmgate": ${P999[warmgate]}}
err = {"direct": ${ERR[direct]}, "nginx": ${ERR[nginx]}, "warmgate": ${ERR[warmgate]}}
sp50 = {"direct": ${SP50[direct]}, "nginx": ${SP50[nginx]}, "passed": ${SP50[passed]}, "counted": ${SP50[counted]}}
sp99 = {"direct": ${SP99[direct]}, "nginx": ${SP99[nginx]}, "passed": ${SP99[passed]}, "counted": ${SP99[counted]}}
serr = {"direct": ${SERR[direct]}, "nginx": ${SERR[nginx]}, "passed": ${SERR[passed]}, "counted": ${SERR[counted]}}
cost = ${COST}
tokens = ${TOKENS}
add50 = {k: p50[k] - p50["direct"] for k in ("nginx", "warmgate")}
add99 = {k: p99[k] - p99["direct"] for k in ("nginx", "warmgate")}
def ratio(a, b):
    return f"{a / b:.2f}" if b > 0 else "n/a (nginx added nothing)"
lines = [
    f"## Proxy overhead (median of ${ROUNDS} interleaved rounds; open loop {${RATE}} req/s for ${DURATION}s over {${CONNS}} connections; wrk -t1 -c{${CONNS}} for saturation)",
    "",
    "| target | saturation req/s | p50 ms | p99 ms | p99.9 ms | added p50 ms | added p99 ms | errors (all rounds) |",
    "|---|---:|---:|---:|---:|---:|---:|---:|",
]
for k in ("direct", "nginx", "warmgate"):
    a50 = f"{add50[k]:.3f}" if k in add50 else "-"
    a99 = f"{add99[k]:.3f}" if k in add99 else "-"
    lines.append(f"| {k} | {rps[k]:.0f} | {p50[k]:.3f} | {p99[k]:.3f} | {p999[k]:.3f} | {a50} | {a99} | {err[k]} |")
lines += [
    "",
    f"- throughput ratio warmgate / nginx: **{rps['warmgate'] / rps['nginx']:.2f}** (goal >= 1)",
    f"- added p99 ratio warmgate / nginx: **{ratio(add99['warmgate'], add99['nginx'])}** (goal <= 1)",
    f"- added p50 ratio warmgate / nginx: {ratio(add50['warmgate'], add50['nginx'])}",
    f"- p99 ratio warmgate / nginx (end to end): {p99['warmgate'] / p99['nginx']:.2f}",
    "",
    f"## Streamed chat answers (16 one-token events as vLLM frames them; open loop {${STREAM_RATE}} req/s for ${DURATION}s, median of ${ROUNDS} rounds)",
    "",
    "| target | p50 ms | p99 ms | added p50 ms | errors (all rounds) |",
    "|---|---:|---:|---:|---:|",
]
for k, name in (("direct", "direct"), ("nginx", "nginx"), ("passed", "warmgate, not counted (/v1/moderations)"), ("counted", "warmgate, tokens counted (/v1/chat/completions)")):
    a50 = f"{sp50[k] - sp50['direct']:.3f}" if k != "direct" else "-"
    lines.append(f"| {name} | {sp50[k]:.3f} | {sp99[k]:.3f} | {a50} | {serr[k]} |")
lines += [
    "",
    f"- cost of counting (counted - not counted, p50, median of the rounds' differences): **{cost:.1f} µs** (goal < 5 µs); rounds: ${COST_ALL}",
    f"- tokens counted during the run (warmgate_tokens_total): {tokens:.0f}",
    "",
    f"## Cold start: the gateway's share ({${COLD_COUNT}} cold starts)",
    "",
    "From the replica answering /healthz to the first held request being forwarded:",
    f"p50 **{${HO_P50}} ms**, p90 {${HO_P90}} ms, max {${HO_MAX}} ms (goal: p50 < 5 ms).",
    f"For scale: spawn-to-ready p50 {${READY_P50}} ms, client-seen cold request p50 {${TOTAL_P50}} ms.",
]
text = "\n".join(lines) + "\n"
open(sys.argv[1], "w").write(text)
print(text)
import json, os, platform, datetime
json.dump({
    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.release()}",
    "rounds": ${ROUNDS}, "rate": ${RATE}, "duration_s": ${DURATION}, "connections": ${CONNS},
    "saturation_rps": rps, "p50_ms": p50, "p99_ms": p99, "p999_ms": p999, "errors": err,
    "added_p50_ms": add50, "added_p99_ms": add99,
    "throughput_vs_nginx": rps["warmgate"] / rps["nginx"],
    "added_p99_vs_nginx": add99["warmgate"] / add99["nginx"] if add99["nginx"] > 0 else None,
    "cold_handoff_ms": {"p50": ${HO_P50}, "p90": ${HO_P90}, "max": ${HO_MAX}},
    "stream_rate": ${STREAM_RATE}, "stream_p50_ms": sp50, "stream_p99_ms": sp99,
    "stream_errors": serr, "counting_cost_us": cost, "tokens_counted": tokens,
}, open(os.path.splitext(sys.argv[1])[0] + ".json", "w"), indent=1)
if ${SMOKE} == 1:
    # The smoke run's figures mean nothing; that it ran, and cleanly, does.
    bad = {k: v for k, v in {**err, **{"stream-" + k: v for k, v in serr.items()}}.items() if v}
    assert not bad, f"requests failed: {bad}"
    assert tokens > 0, "no tokens were counted"
    assert ${COLD_COUNT} == ${COLD_N}, "not every cold start was recorded"
EOF
