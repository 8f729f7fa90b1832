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
#                                      env BIN, ROUNDS, PORT override)
set -euo pipefail
cd "$(dirname "$0")/.."

BIN=${BIN:-target/release/warmgate}
ROUNDS=${ROUNDS:-3}
PORT=${PORT:-18099}
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

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

if curl -s -o /dev/null "http://127.0.0.1:$PORT/healthz"; then
    echo "something already listens on port $PORT (PORT=… to use another)" >&2
    exit 1
fi

printf '| apps | check (s) | first start (s) | second start (s) | first / check | second / check | RSS (MiB) | idle CPU (%%) |\n'
printf '|---:|---:|---:|---:|---:|---:|---:|---:|\n'
for n in "${SIZES[@]}"; do
    file="$work/apps-$n.toml"
    config "$n" "$file" "$work/state"
    checks=() firsts=() seconds=() rss=0 idle=0
    for _ in $(seq 1 "$ROUNDS"); do
        rm -rf "$work/state"
        t0=$(now)
        "$BIN" serve --check --config "$file" >/dev/null 2>&1
        checks+=("$(echo "$(now) - $t0" | bc)")
        start "$file"
        firsts+=("$(cat "$work/took")")
        stop
        start "$file"
        seconds+=("$(cat "$work/took")")
        sleep 2
        rss=$(awk '/VmRSS/ {print int($2 / 1024)}' "/proc/$pid/status")
        c0=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        sleep 10
        c1=$(awk '{print $14 + $15}' "/proc/$pid/stat")
        idle=$(echo "scale=1; ($c1 - $c0) * 100 / $(getconf CLK_TCK) / 10" | bc)
        stop
    done
    check=$(printf '%s\n' "${checks[@]}" | median)
    first=$(printf '%s\n' "${firsts[@]}" | median)
    second=$(printf '%s\n' "${seconds[@]}" | median)
    printf '| %s | %.2f | %.2f | %.2f | %.1f× | %.1f× | %s | %s |\n' "$n" "$check" "$first" "$second" \
        "$(echo "$first / $check" | bc -l)" "$(echo "$second / $check" | bc -l)" "$rss" "$idle"
done
echo
echo "median of $ROUNDS rounds; RSS and idle CPU of the last second start"
