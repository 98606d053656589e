#!/usr/bin/env bash
# with-load.sh N COMMAND...: run COMMAND while N busy loops compete for the CPUs, and stop
# them however COMMAND ends. CI runs `make test` this way (three loops on two CPUs, 2.5x
# oversubscribed) so that a test depending on timing fails there rather than in production.
set -euo pipefail
loops=$1
shift
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for _ in $(seq "$loops"); do
    (while :; do :; done) &
    pids+=($!)
done
"$@"
