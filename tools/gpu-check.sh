#!/usr/bin/env bash
# Everything a GPU check needs, in one command, on a GPU machine without network access:
#   tools/gpu-check.sh DEVICE_DIR OUT_DIR [STAGES]
# DEVICE_DIR holds setup.sh (installs exllamav3 1.6.5 wheels + its prebuilt extension) and
# wheels312/ (test wheels the image lacks, openai for the served tests: tools/device-wheels.sh
# DEVICE_DIR fetches them, here, before the call); OUT_DIR receives logs and
# JSON. STAGES (default "build synth tests bench") picks what runs; "warm" (not in the default)
# runs tools/exl3_warm.py on each synthesized checkpoint in the background, to overlap the
# first-use compiles with the synthesis of the next. A Triton cache found at
# DEVICE_DIR/triton-cache.tar.gz (or in its parts, .part-00 ...) is restored (and saved to
# OUT_DIR in parts when GLM53_SAVE_TRITON is set; only the autotuner's choices, DEVICE_DIR/triton-autotune.tar.gz, when it is "autotune").
# GLM53_GPU_GROUP=a|b|c|d|e|f|g runs one group of tests/gpu (several, comma-separated: side by
# side, below); tests/gpu/groups.txt lists each group's files and the checkpoints they need
# (the synth default; "store" is the slice's store, packed once for the call and named by
# GLM53_TEST_SLICE_STORE); the groups together are the whole of tests/gpu, and groups.txt says
# which groups make the two calls and what each took. With a group, pytest gets SIGINT at
# GLM53_TESTS_DEADLINE seconds after this script started (default 540; 0:
# none), so that a run about to be cut still writes gpu-tests.xml with what ran.
# A checkpoint carried in DEVICE_DIR/ckpt-PRESET.tar.gz (tools/carry-checkpoint.sh: the demo,
# written on the CPU beforehand) is unpacked instead of synthesized while its synth sources'
# hash (tools/synth-stamp.sh) matches these sources; otherwise it is synthesized, and the log
# says why.
# GLM53_SYNTH picks the checkpoints (default: the group's, else "demo slice slice-resharded"; also "deep", and "store": the slice's store), GLM53_GPU_TESTS narrows the tests (paths or node ids; default: the group's, else tests/gpu; one pytest process), GLM53_GPU_TESTS_<g> one side-by-side group's (e.g. GLM53_GPU_TESTS_e), GLM53_BENCH the benchmarks,
# GLM53_BENCH_MODES the gpu_slice rows, GLM53_OFFLOAD_TIMEOUT its stock-offload subprocesses,
# GLM53_GPU_SLICE_ARGS further gpu_slice arguments (e.g. "--model $GLM53_TEST_DEEP --vram-budget 24G"),
# GLM53_GPU_TRACE_ARGS further gpu_trace arguments (GLM53_BENCH=gpu_trace: profiler traces).
# The device tool brings back only a handful of files from $OUT (on 2026-12-01 a call got 8 of its
# 11 and left tests.log out as "count"), so pack the logs into one tarball in the calling command
# when many stages run (tools/gpu-bench-serve.sh's own call did: `tar czf logs.tar.gz logs`).
set -uo pipefail
DEV=$(realpath "${1:?usage: tools/gpu-check.sh DEVICE_DIR OUT_DIR [STAGES]}")
OUT=$(realpath -m "${2:?usage: tools/gpu-check.sh DEVICE_DIR OUT_DIR [STAGES]}")
STAGES=${3:-"build synth tests bench"}
REPO=$(cd "$(dirname "$0")/.." && pwd)
# GLM53_GPU_GROUP=a,c (several, comma-separated): the groups' tests run side by side, one pytest
# process each on the same GPU (own junit gpu-tests-G.xml, log tests-G.log, live log, basetemp),
# after one build and one synth of every checkpoint they need; the deadline holds for each.
GROUPS_LIST=$(echo "${GLM53_GPU_GROUP:-}" | tr ',' ' ')
group_entries() {  # group_entries KIND: the values of this group's KIND lines in groups.txt
  sed 's/#.*//' "$REPO/tests/gpu/groups.txt" |
    awk -v g="$GROUP" -v k="$1" '$1 == g && $2 == k { for (i = 3; i <= NF; i++) print $i }'
}
group_synth="" group_tests="" deadline=0
for GROUP in $GROUPS_LIST; do
  tests_of_group=$(group_entries test | sed 's|^|tests/gpu/|' | tr '\n' ' ')
  if [ -z "$tests_of_group" ]; then
    echo "GLM53_GPU_GROUP=$GLM53_GPU_GROUP: no group $GROUP in tests/gpu/groups.txt" >&2
    exit 2
  fi
  for p in $(group_entries synth); do
    case " $group_synth " in *" $p "*) ;; *) group_synth="$group_synth$p " ;; esac
  done
  group_tests="$group_tests$tests_of_group"
  deadline=${GLM53_TESTS_DEADLINE:-540}
done
GROUP=${GLM53_GPU_GROUP:-}
WORK=${GLM53_GPU_WORK:-/tmp/glm53-gpu}
mkdir -p "$OUT" "$WORK"
export TRITON_CACHE_DIR=$WORK/triton-cache
# one exllamav3 tune file for every process of the machine (warm-ups, reference processes, test
# sessions, servers), kept with the references computed under it: exllamav3 picks GEMM kernels
# by timing at first use and the rounding follows the pick, so a reference equals an engine only
# under the same picks (2026-12-05: one tune file per group, references shared across groups,
# and the 5,000-token prompt and the batch differed). gpu_kit keys shared references by it.
export EXLLAMAV3_TUNE_CACHE=$WORK/exllamav3-tune/coop_autotune_v1.bin
mkdir -p "$WORK/exllamav3-tune"
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
# the CPUs' topology (which vCPUs are SMT siblings: the lane's layout reserves the first cores,
# siblings included, for the engine thread and the lane's poller; issue 26)
log "cpus: $(nproc); siblings of cpu 0/1: $(cat /sys/devices/system/cpu/cpu0/topology/thread_siblings_list \
  /sys/devices/system/cpu/cpu1/topology/thread_siblings_list 2>/dev/null | tr '\n' ' ')"
# a Triton cache from an earlier call (whole, or in parts that the device tool can bring back)
if compgen -G "$DEV/triton-cache.tar.gz*" >/dev/null; then
  mkdir -p "$TRITON_CACHE_DIR"
  cat "$DEV"/triton-cache.tar.gz* | tar -xzf - -C "$TRITON_CACHE_DIR" && log "Triton cache restored"
fi
# only the autotuner's choices (exllamav3's vendored fla kernels cache them: cache_results=True),
# a few kB: with them a first use compiles the chosen configuration of each kernel, not all
if [ -f "$DEV/triton-autotune.tar.gz" ]; then
  mkdir -p "$TRITON_CACHE_DIR"
  tar -xzf "$DEV/triton-autotune.tar.gz" -C "$TRITON_CACHE_DIR" &&
    log "Triton autotune choices restored: $(tar -tzf "$DEV/triton-autotune.tar.gz" | grep -c json) files"
fi

# shellcheck disable=SC1091
source "$DEV/setup.sh" >"$OUT/setup.log" 2>&1 || { log "setup.sh failed"; exit 2; }
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
if [ -d "$DEV/wheels312" ]; then
  pip install -q --no-index --no-deps --target /tmp/site "$DEV"/wheels312/*.whl >>"$OUT/setup.log" 2>&1
fi
export PATH=/tmp/site/bin:$PATH

if stage build; then
  # a warm machine keeps /tmp/site: rebuild only when the sources changed
  stamp=$(cd "$REPO" && find pyx cuda glm53 meson.build meson.options pyproject.toml -type f \
    -not -name '*.pyc' | sort | xargs cat | sha1sum | cut -c1-16)
  if [ -f "$WORK/built-$stamp" ]; then
    log "build: sources unchanged since the last build here ($stamp)"
  else
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader | head -1 | tr -d .)
    run build pip install --no-build-isolation --no-deps --target /tmp/site --upgrade \
      -Csetup-args=-Dcuda=enabled -Csetup-args=-Dgpu_archs="$arch" "$REPO" || exit 1
    touch "$WORK/built-$stamp"
  fi
fi
cd "$WORK" || exit 2  # import the installed package, not the source tree
# the store pack refuses to leave less than 10 % of its filesystem free: say what there is
log "disk at start: $(df -h "$WORK" | tail -1)"

# The checkpoints are written on two chains at once: the slices one after another (the disk is
# their bound) and the demo beside them (its router fit decodes on one CPU thread, about 110 s).
# A preset is ready (WORK/.ready-PRESET; .failed-PRESET if its synth failed) once it is written
# and, with the "warm" stage, warmed by tools/exl3_warm.py (its first-use compiles). Groups run
# side by side each start their tests as soon as their own presets are ready; everything else
# waits for all of them.
ready() {  # ready PRESET: warm it (with the "warm" stage), then mark it ready
  # the resharded slice has the slice's widths (the same kernels); the store is no checkpoint
  if stage warm && [ "$1" != slice-resharded ] && [ "$1" != store ]; then
    local t0=$SECONDS
    log "start warm-$1"
    python3 "$REPO/tools/exl3_warm.py" "$WORK/$1" >"$OUT/warm-$1.log" 2>&1 ||
      log "warm-up of $1 failed (see warm-$1.log)"
    log "end warm-$1 in $((SECONDS - t0)) s: $(grep '^warm ' "$OUT/warm-$1.log" | tr '\n' ';')"
  fi
  touch "$WORK/.ready-$1"
}
carried() {  # carried PRESET: unpack DEVICE_DIR/ckpt-PRESET.tar.gz (tools/carry-checkpoint.sh)
  local tarball="$DEV/ckpt-$1.tar.gz" want got
  [ -f "$tarball" ] || return 1
  want=$("$REPO/tools/synth-stamp.sh")
  got=$(tar -xzf "$tarball" -O "$1/.glm53-synth-stamp" 2>/dev/null)
  if [ "$got" != "$want" ]; then
    log "$tarball was written by other synth sources ($got, these are $want): synthesizing $1"
    # which files differ (the carried list against this tree's; synth-stamp-diff.txt in OUT)
    diff <(tar -xzf "$tarball" -O "$1/.glm53-synth-files" 2>/dev/null) \
      <("$REPO/tools/synth-stamp.sh" --files) >"$OUT/synth-stamp-diff.txt" 2>&1
    log "synth sources that differ: $(grep -c '^[<>]' "$OUT/synth-stamp-diff.txt") lines (synth-stamp-diff.txt)"
    return 1
  fi
  tar -xzf "$tarball" -C "$WORK" && log "$1: carried ($tarball, synth sources $got)"
}
prepare() {  # prepare PRESET...: write each (unless there), one after another; warm each beside
  local preset tmp pids=() rc=0
  for preset in "$@"; do
    # a store an earlier call left (group g flips bytes of it and back; a cut run may not have)
    if [ "$preset" = store ] && [ -d "$WORK/store" ] && ! run compare-store python3 -m glm53 \
      store compare --store "$WORK/store" --model "$WORK/slice" --sample 50; then
      log "the store an earlier call left is not the slice's (compare-store.log): packing again"
      rm -rf "$WORK/store"
    fi
    if [ ! -d "$WORK/$preset" ]; then
      if [ "$preset" = slice-resharded ]; then
        # a second geometry (64 routed experts, not 288: 4.1 GB, not 16, so that a call's disk
        # holds it beside the store) with uniform routing, rewritten in other shards and tensor
        # order by a separate tool; the source goes to RAM (/dev/shm)
        tmp=/dev/shm/glm53-slice-uniform
        rm -rf "$tmp"
        run synth-slice-uniform python3 -m glm53 synth --preset slice --routing uniform \
          --experts 64 --out "$tmp" && run reshard python3 "$REPO/tools/reshard_checkpoint.py" "$tmp" \
          "$WORK/$preset"
        local synth_rc=$?
        rm -rf "$tmp"
      elif [ "$preset" = store ]; then
        # the slice's store, packed once for every group of the call (GLM53_TEST_SLICE_STORE)
        run pack-store python3 -m glm53 store pack --model "$WORK/slice" --out "$WORK/store" \
          --no-mtp
        local synth_rc=$?
      elif carried "$preset"; then
        local synth_rc=0
      else
        run "synth-$preset" python3 -m glm53 synth --preset "$preset" --routing glm53 \
          --out "$WORK/$preset"
        local synth_rc=$?
      fi
      if [ $synth_rc -ne 0 ]; then touch "$WORK/.failed-$preset"; rc=1; continue; fi
    fi
    ready "$preset" &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
  return $rc
}
chain_pids=()
if stage synth; then
  presets=${GLM53_SYNTH:-${group_synth:-demo slice slice-resharded}}
  rm -f "$WORK"/.ready-* "$WORK"/.failed-*
  disk_chain=$(for p in $presets; do case $p in slice) echo "0 $p" ;; slice-resharded) echo "1 $p" ;;
    store) echo "2 $p" ;; demo) ;; *) echo "3 $p" ;; esac; done |
    sort -s -n -k1,1 | cut -d' ' -f2 | tr '\n' ' ')
  case " $presets " in *" demo "*) prepare demo & chain_pids+=($!) ;; esac
  [ -n "$disk_chain" ] && { prepare $disk_chain & chain_pids+=($!); }
fi
wait_chains() {  # every checkpoint written and warmed
  local t0=$SECONDS pid
  for pid in "${chain_pids[@]}"; do wait "$pid" || status=1; done
  chain_pids=()
  log "checkpoints ready, waited $((SECONDS - t0)) s; disk: $(df -h "$WORK" | tail -1)"
}
wait_ready() {  # wait_ready PRESET...: until each is ready (1 if one failed)
  local p
  for p in "$@"; do
    until [ -e "$WORK/.ready-$p" ] || [ -e "$WORK/.failed-$p" ]; do sleep 1; done
    [ -e "$WORK/.ready-$p" ] || return 1
  done
}
export GLM53_TEST_DEMO=$WORK/demo GLM53_TEST_SLICE=$WORK/slice GLM53_TEST_DEEP=$WORK/deep
export GLM53_TEST_SLICE_RESHARDED=$WORK/slice-resharded
# stock exllamav3's reference runs, saved by the pytest process that computed them for the others
# of this call and of later calls on this machine (tests/gpu/gpu_kit.py: one checkpoint's
# reference processes take turns, so side-by-side groups never load it into VRAM at once)
export GLM53_REFERENCE_DIR=$WORK/reference
case " ${GLM53_SYNTH:-${group_synth:-}} " in *" store "*) export GLM53_TEST_SLICE_STORE=$WORK/store ;; esac
deadline_limit() {  # deadline_limit GROUP: `limit`, the prefix that sends pytest SIGINT at the
  # call's deadline (counted from this script's start), so that it still writes its report
  limit=()
  [ "$deadline" -gt 0 ] || return 0
  local left=$((deadline - SECONDS))
  [ "$left" -gt 10 ] || left=10
  limit=(timeout -s INT -k 30 "$left")
  log "tests of group $1: SIGINT after $left s"
}
if stage tests; then
  tests=()  # GLM53_GPU_TESTS paths are relative to the repository (this script runs from $WORK)
  for t in ${GLM53_GPU_TESTS:-${group_tests:-tests/gpu}}; do
    case $t in /*) tests+=("$t") ;; *) tests+=("$REPO/$t") ;; esac
  done
  # --durations=0: every test's time in tests.log, to replace groups.txt's estimates;
  # GLM53_GPU_STRICT: a file skipped for a module it cannot import fails (tests/gpu/conftest.py)
  # GLM53_GPU_LIVE_LOG: each outcome and failure written as the test ends (a cut run keeps them)
  export GLM53_GPU_STRICT=1
  pytest_args=(-q -rs -p no:cacheprovider -o addopts="" --continue-on-collection-errors
    --durations=0 -o junit_family=legacy)
  set -- $GROUPS_LIST
  if [ $# -gt 1 ] && [ -z "${GLM53_GPU_TESTS:-}" ]; then  # several groups: side by side
    pids=()
    for g in "$@"; do
      GROUP=$g
      g_tests=()
      narrow=GLM53_GPU_TESTS_$g  # this group's tests narrowed (paths or node ids), if set
      if [ -n "${!narrow:-}" ]; then
        for t in ${!narrow}; do g_tests+=("$REPO/$t"); done
      else
        for t in $(group_entries test); do g_tests+=("$REPO/tests/gpu/$t"); done
      fi
      g_synth=$(group_entries synth | tr '\n' ' ')
      (export GLM53_GPU_LIVE_LOG=$OUT/tests-live-$g.log
        # shellcheck disable=SC2086  # word splitting intended: a list of presets
        stage synth && { wait_ready $g_synth || log "group $g: a checkpoint failed ($g_synth)"; }
        deadline_limit "$g"
        run "tests-$g" "${limit[@]}" python3 -m pytest "${pytest_args[@]}" \
          --basetemp="$WORK/pytest-$g" --junitxml="$OUT/gpu-tests-$g.xml" "${g_tests[@]}") &
      pids+=($!)
    done
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    GROUP=$GLM53_GPU_GROUP
    wait_chains
  else
    wait_chains
    deadline_limit "$GROUP"
    export GLM53_GPU_LIVE_LOG=$OUT/tests-live.log
    run tests "${limit[@]}" python3 -m pytest "${pytest_args[@]}" \
      --junitxml="$OUT/gpu-tests.xml" "${tests[@]}"
  fi
fi
if stage bench; then
  wait_chains
  # GLM53_BENCH picks the benchmarks, GLM53_BENCH_MODES the gpu_slice rows (default: all);
  # each row is written to OUT/rows/ as soon as it is measured, so a cut run keeps its rows
  for b in ${GLM53_BENCH:-gpu_slice micro_gemv lane_latency}; do
    [ -f "$REPO/bench/$b.py" ] || continue
    extra=()
    if [ "$b" = gpu_slice ]; then
      extra=(--plot "$OUT/gpu_slice.png" --rows-dir "$OUT/rows")
      [ -n "${GLM53_BENCH_MODES:-}" ] && extra+=(--modes "$GLM53_BENCH_MODES")
      [ -n "${GLM53_OFFLOAD_TIMEOUT:-}" ] && extra+=(--offload-timeout "$GLM53_OFFLOAD_TIMEOUT")
      # shellcheck disable=SC2206  # word splitting intended: a list of arguments
      [ -n "${GLM53_GPU_SLICE_ARGS:-}" ] && extra+=(${GLM53_GPU_SLICE_ARGS})
    fi
    # gpu_trace (not in the default list): torch.profiler traces of single scenarios, read into
    # where the time goes; GLM53_GPU_TRACE_ARGS adds to its arguments (e.g. --keep-traces DIR)
    # shellcheck disable=SC2206  # word splitting intended: a list of arguments
    [ "$b" = gpu_trace ] && [ -n "${GLM53_GPU_TRACE_ARGS:-}" ] && extra+=(${GLM53_GPU_TRACE_ARGS})
    run "bench-$b" python3 "$REPO/bench/$b.py" --json "${extra[@]}" \
      && tail -1 "$OUT/bench-$b.log" >"$OUT/$b.json"
  done
fi
[ ${#chain_pids[@]} -eq 0 ] || wait_chains  # a call without tests or bench: the synth alone
# the Triton cache is large (about 150 MB packed); save it only when asked, with what a later
# load needs (the compiled kernels, their metadata and launchers, not the IR), in parts of at
# most 15 MiB (the device tool brings back files of up to 16 MiB)
# The whole cache does not fit the 64 MiB that a call can carry; the autotuner's choices always
# do (GLM53_SAVE_TRITON=autotune saves only those, with a breakdown of the cache in the log)
if [ "${GLM53_SAVE_TRITON:-}" = autotune ] && [ -d "$TRITON_CACHE_DIR" ]; then
  (cd "$TRITON_CACHE_DIR" && find . -type f -name '*autotune*.json' | tar -czf - -T -) \
    >"$OUT/triton-autotune.tar.gz"
  log "Triton autotune choices saved: $(tar -tzf "$OUT/triton-autotune.tar.gz" | grep -c json) files, $(du -h "$OUT/triton-autotune.tar.gz" | cut -f1); cache: $(find "$TRITON_CACHE_DIR" -type f | sed 's/.*\.//' | sort | uniq -c | tr '\n' ' ')$(du -sh "$TRITON_CACHE_DIR" | cut -f1)"
elif [ -n "${GLM53_SAVE_TRITON:-}" ] && [ -d "$TRITON_CACHE_DIR" ]; then
  (cd "$TRITON_CACHE_DIR" && find . -type f \( -name '*.cubin' -o -name '*.json' -o -name '*.so' \) |
    tar -czf - -T -) | split -b 15m -d -a 2 - "$OUT/triton-cache.tar.gz.part-"
  log "Triton cache saved: $(du -ch "$OUT"/triton-cache.tar.gz.part-* | tail -1 | cut -f1)"
fi
log "done, status $status"
exit $status
