#!/usr/bin/env bash
# Run every fuzzer for a bounded time; exit 1 if any found a crash.
#
#   fuzz/run.sh [SECONDS]        seconds per fuzzer (default 45)
#
# C harnesses (fuzz/c/*.c, except replay.c) are built with clang's libFuzzer,
# AddressSanitizer and UndefinedBehaviorSanitizer; Python harnesses
# (fuzz/py/fuzz_*.py) run under atheris and fuzz the `ringlet` that python
# imports (so set PYTHONPATH=src to fuzz a checkout).  Each starts from its
# seeds (fuzz/corpus/NAME) and past finds (fuzz/regressions/NAME); new inputs
# and crash reproducers go to $FUZZ_OUT (default build/fuzz), never into the
# repository.  Add a reproducer to fuzz/regressions/NAME once it is fixed.
set -uo pipefail
cd "$(dirname "$0")/.."
SECS=${1:-45}
OUT=${FUZZ_OUT:-build/fuzz}
CC=${FUZZ_CC:-clang}
PY=${PYTHON:-python}
mkdir -p "$OUT"
failed=()

seeds() {  # the read-only corpus directories of harness $1
    local d
    for d in fuzz/corpus/$1 fuzz/regressions/$1; do [ -d "$d" ] && printf '%s\n' "$d"; done
}

run() {  # name, command...: one bounded fuzzing session
    local name=$1; shift
    mkdir -p "$OUT/corpus/$name" "$OUT/crashes/$name"
    echo "== fuzz $name (${SECS}s)"
    # The outer timeout is a backstop for a fuzzer that hangs outside an input.
    if timeout -k 10 $((SECS + 120)) "$@" -max_total_time="$SECS" -timeout=20 \
            -rss_limit_mb=3072 -print_final_stats=1 \
            -artifact_prefix="$OUT/crashes/$name/" "$OUT/corpus/$name" $(seeds "$name") \
            > "$OUT/$name.log" 2>&1; then
        grep -E "^(Done|stat::number_of_executed_units|stat::peak_rss_mb)" "$OUT/$name.log" || true
    else
        echo "!! fuzz $name FAILED; its log ($OUT/$name.log) ends:"
        tail -40 "$OUT/$name.log"
        ls "$OUT/crashes/$name"
        failed+=("$name")
    fi
}

command -v "$CC" >/dev/null || { echo "fuzz/run.sh: $CC not found (apt-get install clang)"; exit 1; }
for src in fuzz/c/*.c; do
    name=$(basename "$src" .c)
    [ "$name" = replay ] && continue
    if ! "$CC" -g -O1 -std=gnu11 -Wno-pass-failed \
            -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
            -Icsrc "$src" csrc/*.c -pthread -lm -o "$OUT/fuzz_$name"; then
        echo "!! building fuzz/c/$name.c failed"; failed+=("$name"); continue
    fi
    run "$name" "$OUT/fuzz_$name" -max_len=4096
done

for src in fuzz/py/fuzz_*.py; do
    name=$(basename "$src" .py); name=${name#fuzz_}
    run "$name" "$PY" "$src" -max_len=4096
done

if [ ${#failed[@]} -gt 0 ]; then
    echo "fuzz/run.sh: crashes or build failures in: ${failed[*]} (reproducers under $OUT/crashes)"
    exit 1
fi
echo "fuzz/run.sh: no crashes"
