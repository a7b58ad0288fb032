#!/bin/bash
# The start-up of `dspark serve` as a client sees it: docs/limits.md's start-up table.
#   scripts/serve_startup.sh PORT [serve flags...]
# Seconds from launch to /health, to a first 8-token answer, then a 32-token answer every 15 s
# until /health says the compiled graphs are in use, and one after; resident size at the first answer.
set -u
PORT=$1; shift
LOG=$(mktemp)
start=$(date +%s.%N)
.venv/bin/dspark serve --port "$PORT" "$@" > "$LOG" 2>&1 &
PID=$!
trap 'kill $PID 2>/dev/null; wait $PID 2>/dev/null; rm -f "$LOG"' EXIT
since() { echo "$(date +%s.%N) - $1" | bc; }
ask() { curl -sf "localhost:$PORT/v1/completions" -H 'content-type: application/json' -d "$1" > /dev/null; }
for _ in $(seq 1 3000); do curl -sf "localhost:$PORT/health" > /dev/null 2>&1 && break; sleep 0.1; done
echo "health $(since "$start") s"
ask '{"prompt":"Hello","max_tokens":8}'
echo "first 8 tokens $(since "$start") s, resident $(ps -o rss= -p $PID) KB"
ROUNDS=20
case " $* " in *" --no-compile "*) ROUNDS=0 ;; esac     # nothing to wait for
for k in $(seq 1 $ROUNDS); do
  curl -sf "localhost:$PORT/health" | grep -q '"compiled":true' && break
  grep -q "compiling failed\|eager forward" "$LOG" && break
  t0=$(date +%s.%N); ask "{\"prompt\":\"Count to $k\",\"max_tokens\":32,\"temperature\":0}"
  echo "  at $(echo "$t0 - $start" | bc) s: 32 tokens in $(since "$t0") s"; sleep 15
done
grep "dspark:" "$LOG"
t0=$(date +%s.%N); ask '{"prompt":"Count to 99","max_tokens":32,"temperature":0}'
echo "then: 32 tokens in $(since "$t0") s"
