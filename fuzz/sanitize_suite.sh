#!/usr/bin/env bash
# Run the test files that drive the C core against an AddressSanitizer +
# UndefinedBehaviorSanitizer build of the extension; exit 1 on a failing test
# or on any sanitizer report (also from spawned ranks, whose exit a failure
# test may expect anyway).
#
#   fuzz/sanitize_suite.sh [pytest args...]
#
# Builds in place into src/ringlet (objects under build/sanitize) and runs
# with PYTHONPATH=src; an extension already built there is put back after.
# RINGLET_SANITIZE (default address,undefined) picks the sanitizers,
# SANITIZE_TIMEOUT (default 900 s) bounds the test run.
set -uo pipefail
cd "$(dirname "$0")/.."
export RINGLET_SANITIZE=${RINGLET_SANITIZE:-address,undefined}
LIMIT=${SANITIZE_TIMEOUT:-900}
PY=${PYTHON:-python}
if [ $# -gt 0 ]; then TESTS=("$@"); else
    TESTS=(tests/test_c_units.py tests/test_bad_input.py tests/test_collectives.py
           tests/test_failures.py tests/test_concurrency.py tests/test_bulk_recv.py
           tests/test_shm.py tests/test_fuzz.py tests/test_p2p_any.py)
fi
LOGS=build/sanitize/reports
rm -rf "$LOGS" && mkdir -p "$LOGS"

saved=()
for so in src/ringlet/_core*.so; do
    [ -e "$so" ] && mv "$so" "$so.unsanitized" && saved+=("$so")
done
restore() {
    rm -f src/ringlet/_core*.so
    for so in "${saved[@]}"; do mv "$so.unsanitized" "$so"; done
}
trap restore EXIT

echo "== sanitize: building the extension with -fsanitize=$RINGLET_SANITIZE"
"$PY" setup.py build_ext --inplace -q -t build/sanitize/tmp >build/sanitize/build.log 2>&1 \
    || { tail -30 build/sanitize/build.log; echo "sanitizer build failed"; exit 1; }

CC_=$("$PY" -c "import sysconfig; print((sysconfig.get_config_var('CC') or 'gcc').split()[0])")
preload=""
if [[ ",$RINGLET_SANITIZE," == *",address,"* ]]; then
    # Python itself is not instrumented: the ASan runtime must load first.
    preload=$("$CC_" -print-file-name=libasan.so)
    [ -f "$preload" ] || { echo "no libasan.so for $CC_"; exit 1; }
fi
echo "== sanitize: ${TESTS[*]} (at most ${LIMIT}s)"
# Leaks are Python's business here; allocator_may_return_null keeps the
# out-of-memory paths (RL_ERR_NOMEM) what they are in a normal build.
LD_PRELOAD=$preload PYTHONPATH=src \
ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:log_path=$PWD/$LOGS/asan \
UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1:log_path=$PWD/$LOGS/ubsan \
    timeout -k 30 "$LIMIT" "$PY" -m pytest -q -p no:cacheprovider "${TESTS[@]}"
rc=$?
if compgen -G "$LOGS/*" >/dev/null; then
    echo "!! sanitizer reports:"
    for f in "$LOGS"/*; do echo "--- $f"; head -60 "$f"; done
    rc=1
fi
[ $rc -eq 124 ] && echo "!! the sanitized test run passed its ${LIMIT}s limit"
exit $rc
