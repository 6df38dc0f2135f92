#!/usr/bin/env bash
# Everything a GPU check needs, in one command, on a GPU machine without network access:
#   tools/gpu-check.sh DEVICE_DIR OUT_DIR [STAGES]
# DEVICE_DIR holds setup.sh (installs exllamav3 1.6.5 wheels + its prebuilt extension) and
# optionally wheels312/ (build and test wheels for this Python); OUT_DIR receives logs and
# JSON. STAGES (default "build synth tests bench") picks what runs. A Triton cache found at
# DEVICE_DIR/triton-cache.tar.gz is restored, and the cache is saved to OUT_DIR afterwards.
set -uo pipefail
DEV=$(realpath "${1:?usage: tools/gpu-check.sh DEVICE_DIR OUT_DIR [STAGES]}")
OUT=$(realpath -m "${2:?usage: tools/gpu-check.sh DEVICE_DIR OUT_DIR [STAGES]}")
STAGES=${3:-"build synth tests bench"}
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${GLM53_GPU_WORK:-/tmp/glm53-gpu}
mkdir -p "$OUT" "$WORK"
export TRITON_CACHE_DIR=$WORK/triton-cache
export PYTHONUNBUFFERED=1
log() { echo "[gpu-check $(date +%T)] $*" | tee -a "$OUT/gpu-check.log"; }
stage() { case " $STAGES " in *" $1 "*) return 0 ;; *) return 1 ;; esac; }
status=0
run() {  # run NAME CMD...: output to OUT/NAME.log, record rc and seconds
  local name=$1; shift
  local t0=$SECONDS
  log "start $name: $*"
  "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  log "end $name rc=$rc in $((SECONDS - t0)) s"
  echo "{\"stage\": \"$name\", \"rc\": $rc, \"seconds\": $((SECONDS - t0))}" >>"$OUT/stages.jsonl"
  [ $rc -eq 0 ] || status=1
  return $rc
}

nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
  --format=csv >"$OUT/nvidia-smi.csv" 2>&1
[ -f "$DEV/triton-cache.tar.gz" ] && mkdir -p "$TRITON_CACHE_DIR" && tar -xzf "$DEV/triton-cache.tar.gz" -C "$TRITON_CACHE_DIR"

# shellcheck disable=SC1091
source "$DEV/setup.sh" >"$OUT/setup.log" 2>&1 || { log "setup.sh failed"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$DEV/wheels312" ]; then
  pip install -q --no-index --no-deps --target /tmp/site "$DEV"/wheels312/*.whl >>"$OUT/setup.log" 2>&1
fi
export PATH=/tmp/site/bin:$PATH

if stage build; then
  arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
  run build pip install --no-build-isolation --no-deps --target /tmp/site \
    -Csetup-args=-Dcuda=enabled -Csetup-args=-Dgpu_archs="$arch" "$REPO" || exit 1
fi
cd "$WORK" || exit 2  # import the installed package, not the source tree

if stage synth; then
  [ -d "$WORK/demo" ] || run synth-demo python3 -m glm53 synth --preset demo --routing glm53 --out "$WORK/demo"
  [ -d "$WORK/slice" ] || run synth-slice python3 -m glm53 synth --preset slice --routing glm53 --out "$WORK/slice"
fi
export GLM53_TEST_DEMO=$WORK/demo GLM53_TEST_SLICE=$WORK/slice
if stage tests; then
  run tests python3 -m pytest -q -p no:cacheprovider -o addopts="" --junitxml="$OUT/gpu-tests.xml" "$REPO/tests/gpu"
fi
if stage bench; then
  for b in gpu_slice micro_gemv; do
    [ -f "$REPO/bench/$b.py" ] || continue
    extra=(); [ "$b" = gpu_slice ] && extra=(--plot "$OUT/gpu_slice.png")
    run "bench-$b" python3 "$REPO/bench/$b.py" --json "${extra[@]}" \
      && tail -1 "$OUT/bench-$b.log" >"$OUT/$b.json"
  done
fi
[ -d "$TRITON_CACHE_DIR" ] && tar -czf "$OUT/triton-cache.tar.gz" -C "$TRITON_CACHE_DIR" .
log "done, status $status"
exit $status
