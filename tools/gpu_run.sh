#!/usr/bin/env bash
# kiln on a GPU machine without network, in one call of at most 10 minutes (docs/cuda.md, "Running on a
# GPU machine"): installs the wheels of .gpu/ (made here by tools/gpu_bundle.py) into a prefix, then runs
#   check  `kiln cuda check --no-emulate --arch sm_90`    -> $OUT/check.log
#   tests  pytest -m gpu -rs over packages/*/tests        -> $OUT/tests.log
#   bench  packages/kernels-cuda/bench/bench_gpu.py       -> $OUT/bench.log (and $OUT/bench.json)
# each under its own time limit, and prints a summary ($OUT/summary.txt). The install's log is
# $OUT/install.log, what was found (GPU, versions, plugins) $OUT/env.txt. The benchmark alone fills a
# call, so it is a call of its own:
#
#   bash tools/gpu_run.sh                  # check and tests: one call
#   bash tools/gpu_run.sh bench            # the benchmark: a second call
#   bash tools/gpu_run.sh install          # no step: the install and env.txt only
#
# Settings (environment): KILN_GPU_PYTHON (python3), KILN_GPU_BUNDLE (.gpu), KILN_GPU_SITE (/tmp/site),
# KILN_GPU_CHECK_S (150), KILN_GPU_TESTS_S (360), KILN_GPU_BENCH_S (540): seconds for each step;
# KILN_GPU_CHECK_ARGS (--no-emulate --arch sm_90): the flags of `kiln cuda check`; KILN_GPU_BENCH_ARGS
# (none): bench_gpu.py's flags, e.g. --rounds 1 or --sides kiln-bf16,eager-bf16.
# Exits 0 when every step passed, 1 when one failed or ran out of time, 2 when the install or the
# preflight failed or a step is unknown.
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-/tmp/kiln-gpu-out}
PY=${KILN_GPU_PYTHON:-python3}
BUNDLE=${KILN_GPU_BUNDLE:-.gpu}
SITE=${KILN_GPU_SITE:-/tmp/site}
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(check tests)
for step in "${steps[@]}"; do
    case $step in
    install | check | tests | bench) ;;
    *) echo "unknown step '$step' (install, check, tests, bench)"; exit 2 ;;
    esac
done
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
summary="$OUT/summary.txt"
: > "$summary"
note() { echo "$*" | tee -a "$summary"; }

# install: --prefix, not --target: pip --target drops a wheel's data files under lib/ (mpich's libmpi)
shopt -s nullglob
wheels=("$BUNDLE"/*.whl)
if [ ${#wheels[@]} -eq 0 ]; then
    note "no wheels in $BUNDLE: run 'python tools/gpu_bundle.py' on the machine that calls, and carry .gpu"
    exit 2
fi
start=$SECONDS
if ! "$PY" -m pip install --no-index --no-deps --no-compile --no-cache-dir --ignore-installed \
        --disable-pip-version-check --prefix "$SITE" "${wheels[@]}" > "$OUT/install.log" 2>&1; then
    tail -20 "$OUT/install.log"
    note "install: FAILED (pip, see install.log)"
    exit 2
fi
core=$(find "$SITE" -maxdepth 5 -type d -name 'kiln_core-*.dist-info' | head -1)
if [ -z "$core" ]; then
    note "install: FAILED (no kiln_core dist-info under $SITE)"
    exit 2
fi
export PYTHONPATH="$(dirname "$core")${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$SITE/bin:$PATH"                                  # kiln, mpiexec
export LD_LIBRARY_PATH="$SITE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"  # libmpi for mpi4py
"$PY" tools/gpu_preflight.py --site "$SITE" > "$OUT/env.txt" 2>&1
preflight=$?
cat "$OUT/env.txt"
note "install: ${#wheels[@]} wheels into $SITE in $((SECONDS - start)) s; preflight exit $preflight (env.txt)"
[ $preflight -eq 0 ] || exit 2

failed=0
# run STEP SECONDS LOG COMMAND...: the command under `timeout`, its exit and time in the summary
run() {
    local step=$1 limit=$2 log=$3 begin=$SECONDS rc
    shift 3
    echo "== $step: $* (limit ${limit} s)"
    timeout -k 10 "$limit" "$@" > "$log" 2>&1
    rc=$?
    local verdict=passed
    [ $rc -ne 0 ] && verdict="FAILED (exit $rc)" && failed=1
    [ $rc -eq 124 ] || [ $rc -eq 137 ] && verdict="TIMED OUT after ${limit} s"
    note "$step: $verdict in $((SECONDS - begin)) s ($(basename "$log")): $(grep -v '^\s*$' "$log" | tail -1)"
}

for step in "${steps[@]}"; do
    case $step in
    install) ;;  # only the install and what it found (env.txt)
    check)
        # the emulator's column and the sm_80 build are every default test run's; here device time counts
        read -ra flags <<< "${KILN_GPU_CHECK_ARGS---no-emulate --arch sm_90}"
        run check "${KILN_GPU_CHECK_S:-150}" "$OUT/check.log" kiln cuda check "${flags[@]}" ;;
    tests)
        extra=()
        "$PY" -c "import pytest_timeout" 2>/dev/null && extra=(--timeout=240)  # one hung test is not all
        run tests "${KILN_GPU_TESTS_S:-360}" "$OUT/tests.log" "$PY" -m pytest -m gpu -rs \
            --continue-on-collection-errors "${extra[@]}" packages/*/tests ;;
    bench)
        bench=packages/kernels-cuda/bench/bench_gpu.py
        read -ra extra <<< "${KILN_GPU_BENCH_ARGS-}"
        "$PY" "$bench" --help 2>/dev/null | grep -q -- '--json' && extra+=(--json "$OUT/bench.json")
        run bench "${KILN_GPU_BENCH_S:-540}" "$OUT/bench.log" "$PY" "$bench" "${extra[@]}" ;;
    esac
done
echo "== summary ($OUT)"
cat "$summary"
exit $failed
