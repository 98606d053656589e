#!/bin/sh
# run.sh BIN MODE SECONDS: fuzz with tests/fuzz/build/fuzz_segment for SECONDS on a copy of the
# seed corpus (MODE validate or hostile pins the harness's mode; any mixes both), or with
# fuzz_kernel (MODE kernel, from an empty corpus: its inputs are small). SIGINT or SIGTERM
# to this script ends the run early, and cleanly unless the fuzzer had found something
# (scripts/with-fuzzing.sh stops its fuzzers so). libFuzzer's output goes to
# BUILD/fuzz-MODE.log; a crash, leak, UB report or hang exits non-zero with the input left
# in BUILD/ (crash-*, leak-*, timeout-*, oom-*).
set -eu
bin=$1 mode=$2 secs=$3
build=$(dirname "$bin")
seeds=$(dirname "$0")/corpus
case $mode in
validate | hostile) corpus=$build/corpus-$mode; PDHAL_FUZZ_MODE=$mode; export PDHAL_FUZZ_MODE ;;
any) corpus=$build/corpus; unset PDHAL_FUZZ_MODE ;;
kernel) corpus=$build/corpus-kernel; seeds= ;;
*) echo "run.sh: mode must be validate, hostile, any or kernel" >&2; exit 2 ;;
esac
mkdir -p "$corpus"
[ -z "$seeds" ] || cp "$seeds"/* "$corpus"/
log=$build/fuzz-$mode.log
UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1}
export UBSAN_OPTIONS
interrupted=72 # what libFuzzer exits with when a signal ends the run (-interrupted_exitcode)
echo "fuzz_segment: $mode mode for $secs s (or until stopped) on $corpus (log: $log)"
"$bin" -max_total_time="$secs" -timeout=10 -max_len=20000 -print_final_stats=1 \
    -interrupted_exitcode=$interrupted -artifact_prefix="$build/" "$corpus" >"$log" 2>&1 &
fuzzer=$!
stopped=
trap 'stopped=1; kill -TERM "$fuzzer" 2>/dev/null || true' INT TERM
# A signal trapped here ends `wait` early; the fuzzer's own status comes with the next one.
while :; do
    status=0
    wait "$fuzzer" || status=$?
    kill -0 "$fuzzer" 2>/dev/null || break
done
if [ "$status" = $interrupted ] && [ -n "$stopped" ]; then
    status=0
fi
if [ "$status" != 0 ]; then
    tail -n 80 "$log"
    echo "fuzz_segment: FAILED in $mode mode: the input is in $build/ (crash-*, leak-*," \
        "timeout-*, oom-*); replay it with: $bin FILE" >&2
    exit 1
fi
grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|^stat::(number_of_executed_units|average_exec_per_sec|peak_rss_mb)' "$log"
