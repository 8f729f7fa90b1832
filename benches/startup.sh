#!/usr/bin/env bash
# Start-up with many apps, measured against a baseline in the same run:
# the time until `warmgate serve` answers /healthz, for N apps with
# `min = 0` (none running), on a fresh state folder (a first start, which
# writes every app's revision 1) and again on the state it left (a second
# start, which writes nothing); against `warmgate serve --check` on the
# same file (reading and checking the config, nothing started). Then the
# second start's resident memory and its CPU over ten idle seconds.
#
# Usage: benches/startup.sh [N ...]   (default 1000 4000 10000;
#                                      env BIN, ROUNDS, PORT override;
#                                      SMOKE=1: 50 and 200 apps, one round,
#                                      a second idle, on the debug build, on
#                                      a free port, failing unless every
#                                      start listed all N apps)
set -euo pipefail
cd "$(dirname "$0")/.."

SMOKE=${SMOKE:-0}
if [ "$SMOKE" = 1 ]; then
    BIN=${BIN:-target/debug/warmgate} ROUNDS=${ROUNDS:-1} SETTLE_S=${SETTLE_S:-0.5} IDLE_S=${IDLE_S:-1}
    PORT=${PORT:-$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')}
    [ $# -gt 0 ] || set -- 50 200
    # The smoke run asks each start for its apps: an admin token for it.
    export WARMGATE_ADMIN_TOKEN="bench-$RANDOM$RANDOM"
    cargo build --workspace --bins -q
    # Never a release build in a smoke run.
    [ -x "$BIN" ] || { echo "startup smoke: no $BIN" >&2; exit 1; }
fi
BIN=${BIN:-target/release/warmgate}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-18099}
# Seconds after the second start before its RSS is read, and of idle CPU.
SETTLE_S=${SETTLE_S:-2}
IDLE_S=${IDLE_S:-10}
SIZES=("${@:-1000 4000 10000}")
# shellcheck disable=SC2206
SIZES=(${SIZES[*]})
[ -x "$BIN" ] || cargo build --release -p warmgate-gateway --bin warmgate

work=$(mktemp -d)
pid=
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

config() { # N FILE STATE
    {
        printf 'listen = "127.0.0.1:%s"\nstate_dir = "%s"\n\n' "$PORT" "$3"
        for i in $(seq -w 1 "$1"); do
            printf '[[apps]]\nname = "app%s"\ncommand = ["python3", "-m", "http.server", "$PORT"]\n[apps.autoscale]\nmin = 0\nmax = 2\n\n' "$i"
        done
    } >"$2"
}

now() { date +%s.%N; }

# Starts the gateway (its pid in $pid); writes the seconds until /healthz
# answers to $work/took.
start() { # FILE
    local t0 t1
    t0=$(now)
    "$BIN" serve --config "$1" >"$work/log" 2>&1 &
    pid=$!
    for _ in $(seq 1 12000); do
        if curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz"; then
            t1=$(now)
            echo "$t1 - $t0" | bc >"$work/took"
            if [ "$SMOKE" = 1 ]; then smoke_check_apps "$N_APPS"; fi
            return
        fi
        kill -0 "$pid" 2>/dev/null || { cat "$work/log" >&2; exit 1; }
        sleep 0.005
    done
    echo "not listening after 60 s" >&2
    exit 1
}

stop() {
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    pid=
}

# Smoke: the gateway that answers /healthz has every app of the file.
smoke_check_apps() { # N
    local got
    got=$(curl -sf -H "authorization: Bearer $WARMGATE_ADMIN_TOKEN" "http://127.0.0.1:$PORT/v1/apps" |
        python3 -c 'import json,sys; print(len(json.load(sys.stdin)["apps"]))') || got="no answer"
    [ "$got" = "$1" ] || { echo "startup smoke: /v1/apps lists $got apps of $1" >&2; exit 1; }
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

if curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz"; then
    echo "something already listens on port $PORT (PORT=… to use another)" >&2
    exit 1
fi

printf '| apps | check (s) | first start (s) | second start (s) | first / check | second / check | RSS (MiB) | idle CPU (%%) |\n'
printf '|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for n in "${SIZES[@]}"; do
    file="$work/apps-$n.toml"
    N_APPS=$n
    config "$n" "$file" "$work/state"
    checks=() firsts=() seconds=() rss=0 idle=0
    for _ in $(seq 1 "$ROUNDS"); do
        rm -rf "$work/state"
        t0=$(now)
        "$BIN" serve --check --config "$file" >/dev/null 2>&1 ||
            { "$BIN" serve --check --config "$file" >&2; exit 1; }
        checks+=("$(echo "$(now) - $t0" | bc)")
        start "$file"
        firsts+=("$(cat "$work/took")")
        stop
        start "$file"
        seconds+=("$(cat "$work/took")")
        sleep "$SETTLE_S"
        rss=$(awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$pid/status")
        c0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        sleep "$IDLE_S"
        c1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        idle=$(echo "scale=1; ($c1 - $c0) * 100 / $(getconf CLK_TCK) / $IDLE_S" | bc)
        stop
    done
    check=$(printf '%s\n' "${checks[@]}" | median)
    first=$(printf '%s\n' "${firsts[@]}" | median)
    second=$(printf '%s\n' "${seconds[@]}" | median)
    printf '| %s | %.2f | %.2f | %.2f | %.1f× | %.1f× | %s | %s |\n' "$n" "$check" "$first" "$second" \
        "$(echo "$first / $check" | bc -l)" "$(echo "$second / $check" | bc -l)" "$rss" "$idle"
    if [ "$SMOKE" = 1 ] && ! [ "$rss" -gt 0 ] 2>/dev/null; then
        echo "startup smoke: no RSS read for $n apps ('$rss')" >&2
        exit 1
    fi
done
echo
echo "median of $ROUNDS rounds; RSS and idle CPU of the last second start"
if [ "$SMOKE" = 1 ]; then
    echo "startup smoke: ok" >&2
fi
