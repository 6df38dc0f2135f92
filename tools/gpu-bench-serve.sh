#!/usr/bin/env bash
# One device call of server-side GPU benchmarks on the slice, after tools/gpu-check.sh has built
# and synthesized (stages "build synth"): exact mode served at the 24 GB card's cache share, then
#   bench/prefix_cache.py --url    (issue 14: later turns' TTFT against a cold prompt)
#   bench/logprobs_overhead.py     (issue 15: decode tok/s with top_logprobs 5 against without)
#   glm53 reference make --engine stock-exllamav3 + bench/score_ref_panel.py (issue 15)
# and, before the server starts (it uses every core), bench/micro_gemv.py on the host (issue 16).
#   tools/gpu-bench-serve.sh OUT_DIR [SECONDS_LEFT]
# Each step is bounded by what is left of SECONDS_LEFT (default 420); results go to OUT_DIR as
# JSON (the last line of each bench) and the logs to OUT_DIR/logs.
set -uo pipefail
OUT=$(realpath -m "${1:?usage: tools/gpu-bench-serve.sh OUT_DIR [SECONDS_LEFT]}")
BUDGET=${2:-420}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${GLM53_GPU_WORK:-/tmp/glm53-gpu}
SLICE=${GLM53_TEST_SLICE:-$WORK/slice}
SLOTS=${GLM53_BENCH_SLOTS:-197}
STEPS=" ${GLM53_BENCH_STEPS:-micro_gemv prefix_cache logprobs_overhead panel} "  # which steps run
want() { case $STEPS in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
mkdir -p "$OUT/logs"
t_end=$((SECONDS + BUDGET))
left() { echo $((t_end - SECONDS)); }
log() { echo "[gpu-bench-serve $(date +%T)] $*" | tee -a "$OUT/logs/gpu-bench-serve.log"; }
bounded() {  # bounded NAME MAX_S CMD...: at most MAX_S (and what is left), JSON last line to OUT/NAME.json
  local name=$1 max=$2; shift 2
  local t=$(( $(left) < max ? $(left) : max ))
  [ "$t" -gt 5 ] || { log "skip $name: no time left"; return 1; }
  log "start $name (limit $t s): $*"
  timeout -s INT "$t" "$@" >"$OUT/logs/$name.log" 2>&1
  local rc=$?
  log "end $name rc=$rc"
  [ $rc -eq 0 ] && tail -1 "$OUT/logs/$name.log" >"$OUT/$name.json"
  return $rc
}
cd "$WORK" || exit 2

want micro_gemv && bounded micro_gemv 110 python3 "$REPO/bench/micro_gemv.py" --json --threads 1,4,14 --jobs 12

port=30000
log "serve $SLICE exact, --ec-max-slots $SLOTS"
python3 -m glm53 serve --engine gpu --mode exact --model "$SLICE" --context 16384 \
  --chunk-size 2048 --max-batch 4 --ec-max-slots "$SLOTS" --port $port \
  >"$OUT/logs/server.log" 2>&1 &
srv=$!
url=http://127.0.0.1:$port
healthy() { python3 -c "import sys,urllib.request as u; sys.exit(u.urlopen(sys.argv[1], timeout=2).status != 200)" "$url/health" 2>/dev/null; }
until healthy; do
  kill -0 $srv 2>/dev/null || { log "server exited"; exit 1; }
  [ "$(left)" -gt 5 ] || { log "server not ready in time"; kill $srv; exit 1; }
  sleep 1
done
log "server ready"

want prefix_cache && bounded prefix_cache 200 python3 "$REPO/bench/prefix_cache.py" --url "$url" --json --timeout 180
want logprobs_overhead && bounded logprobs_overhead 90 python3 "$REPO/bench/logprobs_overhead.py" --url "$url" --json \
  --tokens 128 --rounds 8 --top-k 5
want panel && bounded reference_make 90 python3 -m glm53 reference make --model "$SLICE" \
  --engine stock-exllamav3 --out "$OUT/stock-panel.json" &&
  bounded score_ref_panel 60 python3 "$REPO/bench/score_ref_panel.py" --url "$url" \
    --panel "$OUT/stock-panel.json" --json
python3 -c "import sys,urllib.request as u; print(u.urlopen(sys.argv[1], timeout=10).read().decode())" "$url/stats" >"$OUT/stats.json"
kill -TERM $srv; wait $srv
log "done"
