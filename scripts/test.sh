#!/usr/bin/env bash
# The test command: builds dflash (CUDA sources too when nvcc is present), runs the whole suite with
# ctest, then the whole suite again under AddressSanitizer + UndefinedBehaviorSanitizer (CPU build),
# then fuzzes the file readers (scripts/fuzz.sh, clang + libFuzzer) for DFLASH_FUZZ_SECONDS each.
# Env: DFLASH_TEST_ASAN=0 skips the sanitizer pass, DFLASH_FUZZ_SECONDS=0 the fuzzing (default 30);
# JOBS sets build parallelism.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
jobs=${JOBS:-$(nproc)}
[ -z "${CUDACXX:-}" ] && [ -x /usr/local/cuda/bin/nvcc ] && ! command -v nvcc >/dev/null && export CUDACXX=/usr/local/cuda/bin/nvcc

fetch_log=$(mktemp)
if gguf=$(scripts/fetch_smollm2.sh 2>"$fetch_log"); then
  export DFLASH_SMOLLM2_GGUF="$gguf"
else
  export DFLASH_SMOLLM2_SKIP_REASON="$(tail -n 1 "$fetch_log")"
  echo "test: SmolLM2 tests will be SKIPPED: $DFLASH_SMOLLM2_SKIP_REASON"
fi
rm -f "$fetch_log"

cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release
cmake --build build -j "$jobs"
if [ -f build/CMakeCache.txt ] && grep -q '^DFLASH_CUDA:BOOL=ON' build/CMakeCache.txt; then
  echo "test: CUDA sources compiled. GPU tests are SKIPPED here (no GPU); they run in scripts/gpu_check.sh on a GPU machine."
fi
(cd build && ctest --output-on-failure -j "$jobs")

if [ "${DFLASH_TEST_ASAN:-1}" != 0 ]; then
  echo "test: second pass: the whole suite under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
  cmake -S . -B build-asan -G Ninja -DCMAKE_BUILD_TYPE=Debug -DDFLASH_CUDA=OFF -DDFLASH_SANITIZE=address,undefined
  cmake --build build-asan -j "$jobs" --target dflash_tests dflash
  (cd build-asan && UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
     ctest --output-on-failure -j "$jobs")
fi

fuzz_secs=${DFLASH_FUZZ_SECONDS:-30}
if [ "$fuzz_secs" != 0 ]; then
  echo "test: third pass: fuzzing the file readers, ${fuzz_secs}s each (build-fuzz/)"
  scripts/fuzz.sh "$fuzz_secs"
fi
echo "test: all passes succeeded"
