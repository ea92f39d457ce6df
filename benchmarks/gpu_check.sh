#!/usr/bin/env bash
# One GPU session that validates a change: the CUDA tests of the op families, the GPU time of every
# op family against an older commit (alternate runs, so the run-to-run spread is measured too), the
# eager host cost per call beside torch's, and what each private API saves (host_paths.py). Each step has its own time limit and writes under OUT,
# so a slow step costs only its own figures.
#
#   OLD=/path/to/old/checkout OUT=/path/to/out bash benchmarks/gpu_check.sh   (paths relative to the caller's directory too)
#
# OLD holds the older `llmkernels` package (e.g. `git archive <commit> llmkernels | tar -x -C OLD`).
# WHEELS (optional): a folder of wheels to install first (pytest-xdist, liger-kernel, ...).
# TINY=1: tiny shapes and one test file, to check this script on a machine without a GPU.
# STEPS (optional): the steps to run, of "tests host generate speed" (all by default) and "fuzz"
# (only when named: FUZZ_CASES, FUZZ_PROCS, FUZZ_S, FUZZ_SEED, FUZZ_GPUS), so that a session can split them over
# calls of at most 10 minutes each.
set -u
: "${OUT:?set OUT}" "${OLD:?set OLD}"
mkdir -p "$OUT"
# Absolute paths, taken from the caller's directory: the speed step runs from OLD.
OUT=$(cd "$OUT" && pwd) && OLD=$(cd "$OLD" && pwd) || exit 2
[ -n "${WHEELS:-}" ] && { WHEELS=$(cd "$WHEELS" && pwd) || exit 2; }
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
site=
if [ -n "${WHEELS:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHEELS"/*.whl \
    && site=/tmp/site
fi
here=$PWD
export PYTHONPATH="$here${site:+:$site}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
  date -u +%Y-%m-%dT%H:%MZ; } > "$OUT/env.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...: run with a limit, log to OUT/NAME.log, print its tail
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"; tail -n "${TAIL:-6}" "$OUT/$name.log"
}

tiny=(); tests=(tests/test_norm.py tests/test_cross_entropy.py tests/test_rope.py tests/test_glu.py
  tests/test_log_probs.py tests/test_distill.py tests/test_z_loss.py tests/test_post_training_example.py
  tests/test_modules.py tests/test_examples.py tests/test_argument_names.py tests/test_compile.py tests/test_hf.py
  tests/test_register.py tests/test_private_apis.py)
[ "${TINY:-0}" = 1 ] && tiny=(--tiny) && tests=() && ONLY_OFF=1
steps=" ${STEPS:-tests host generate speed} "
want() { [[ $steps == *" $1 "* ]]; }
want tests && step tests "${TESTS_S:-170}" python3 -m pytest -q -n 8 -p no:cacheprovider --maxfail=25 tests/test_launch.py "${tests[@]}"
want host && step host "${HOST_S:-60}" python3 benchmarks/profile_overhead.py "${tiny[@]}" --budget $(( ${HOST_S:-60} - 15 )) \
  --out "$OUT/host.json"
want host && step host_paths 40 python3 benchmarks/host_paths.py --out "$OUT/host_paths.json"
want generate && step generate "${GENERATE_S:-120}" python3 benchmarks/generate_bench.py "${tiny[@]}" \
  --out "$OUT/generate.json"
if want fuzz; then  # the fuzzer's long run: FUZZ_CASES over FUZZ_PROCS processes sharing one Triton cache
  # (the parts' files stay out of OUT: a call brings back at most 8 files; their failures are in fuzz.log)
  # (FUZZ_GPUS: the processes spread over that many GPUs, a process on GPU i % FUZZ_GPUS)
  n=${FUZZ_PROCS:-12}; per=$(( (${FUZZ_CASES:-5600} + n - 1) / n )); t0=$SECONDS; parts=$(mktemp -d)
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$here/.triton-cache}
  for i in $(seq 0 $((n - 1))); do
    env ${FUZZ_GPUS:+CUDA_VISIBLE_DEVICES=$((i % FUZZ_GPUS))} python3 -m llmkernels.fuzz --cases $per --start $((i * per)) --seed "${FUZZ_SEED:-2026112702}" \
      --budget "${FUZZ_S:-420}" --out "$parts/part$i.json" > "$parts/part$i.log" 2>&1 &
  done
  wait
  { grep -h -A1 "FAIL" "$parts"/part*.log
    python3 -m llmkernels.fuzz --merge "$parts"/part*.json --out "$OUT/fuzz.json" 2>&1 | tail -n 30; } | tee "$OUT/fuzz.log"
  echo "== fuzz: $((SECONDS - t0)) s"
fi
want speed || exit 0
only=(--only "rms_norm N=4096" "rms_norm N=32768" "rms_norm N=131072" "layer_norm N=4096" "layer_norm N=65536"
      "add_rms_norm N=8192" "add_rms_norm N=131072" cross apply glu)
[ "${ONLY_OFF:-0}" = 1 ] && only=()
for i in 1 2; do
  (cd "$OLD" && export PYTHONPATH="$OLD${site:+:$site}" && step "speed-old$i" 90 python3 "$here/benchmarks/speed_compare.py" \
     "${only[@]}" "${tiny[@]}" --out "$OUT/old$i.json")
  step "speed-new$i" 90 python3 benchmarks/speed_compare.py "${only[@]}" "${tiny[@]}" --out "$OUT/new$i.json"
done
TAIL=60 step compare 30 python3 benchmarks/speed_compare.py --compare "$OUT/old1.json" "$OUT/new1.json" \
  "$OUT/old2.json" "$OUT/new2.json"
