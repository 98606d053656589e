#!/usr/bin/env bash
# with-fuzzing.sh COMMAND...: run COMMAND while the three fuzzers of `make fuzz-ci` (the
# segment validator, the hostile per-chunk decoder, the kernel entry points) run beside it
# for as long as it does; fail if COMMAND failed or a fuzzer found something. CI runs
# `make test` this way: three processes that never sleep oversubscribe the two CPUs 2.5x,
# as with-load.sh's busy loops do, and the CPU they take fuzzes (several minutes per
# harness) instead of spinning. The harnesses must be built (`make fuzz-harnesses`).
set -euo pipefail
cd "$(dirname "$0")/.."
build=tests/fuzz/build
fuzzers=()
trap 'kill "${fuzzers[@]}" 2>/dev/null || true' EXIT
for mode in validate hostile kernel; do
    bin=$build/fuzz_segment
    [ "$mode" = kernel ] && bin=$build/fuzz_kernel
    # (an hour at most: fuzzers left behind by a run killed outright end by themselves)
    sh tests/fuzz/run.sh "$bin" "$mode" 3600 &
    fuzzers+=($!)
done
status=0
"$@" || status=$?
# Each run.sh ends its fuzzer on SIGTERM and exits 0 unless the fuzzer found something.
kill -TERM "${fuzzers[@]}" 2>/dev/null || true
for fuzzer in "${fuzzers[@]}"; do
    wait "$fuzzer" || status=1
done
fuzzers=()
exit "$status"
