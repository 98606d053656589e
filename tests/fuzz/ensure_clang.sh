#!/bin/sh
# ensure_clang.sh: make sure $FUZZ_CC (default clang) links a libFuzzer + ASan + UBSan binary.
# As root with apt-get it installs what is missing (clang; libFuzzer's runtime,
# libclang_rt.fuzzer-*.a, is in libclang-rt-N-dev, N the clang major: 14 on Debian 12);
# otherwise it says what to install and fails.
set -u
cc=${FUZZ_CC:-clang}

probe() {
    command -v "$cc" >/dev/null 2>&1 || return 1
    tmp=$(mktemp -d) || return 1
    printf '%s\n' '#include <stddef.h>' '#include <stdint.h>' \
        'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }' \
        >"$tmp/probe.c"
    "$cc" -fsanitize=fuzzer,address,undefined "$tmp/probe.c" -o "$tmp/probe" >/dev/null 2>&1
    rc=$?
    rm -rf "$tmp"
    return $rc
}

apt_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null 2>&1 ||
        { apt-get update -q >/dev/null 2>&1 &&
          DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@" >/dev/null; }
}

probe && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    if ! command -v "$cc" >/dev/null 2>&1 && [ "$cc" = clang ]; then
        echo "fuzz: installing clang (apt-get)"
        apt_install clang
    fi
    probe && exit 0
    major=$("$cc" -dumpversion 2>/dev/null | cut -d. -f1)
    if [ -n "$major" ]; then
        echo "fuzz: installing libclang-rt-$major-dev (libFuzzer's runtime)"
        apt_install "libclang-rt-$major-dev"
        probe && exit 0
    fi
fi
echo "fuzz: $cc cannot build with -fsanitize=fuzzer,address,undefined. Install clang and its" >&2
echo "fuzz: compiler-rt (Debian 12: apt-get install clang libclang-rt-14-dev), or set FUZZ_CC." >&2
exit 1
