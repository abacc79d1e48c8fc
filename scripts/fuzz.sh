#!/usr/bin/env bash
# Fuzzes the file readers with libFuzzer under AddressSanitizer + UndefinedBehaviorSanitizer:
# safetensors, GGUF (+ its tokenizer), config.json (model and drafter), tokenizer.json, chat data.
# Seeds: fuzz/seeds/<target>/ and small fixtures. A crash, sanitizer report, leak or hang fails the
# run; the input that did it is left in fuzz/crashes/<target>/ (keep it in fuzz/regressions/<target>/,
# which every run replays first, and add a test beside the reader's tests).
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET (default 60)]
# Env: FUZZ_SEED (libFuzzer's seed, default 1: runs are reproducible; another one explores anew),
#      JOBS (build parallelism).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
secs=${1:-60}
jobs=${JOBS:-$(nproc)}
command -v clang++ >/dev/null || { echo "fuzz: clang++ not found (scripts/setup.sh installs it)"; exit 2; }
CC=clang CXX=clang++ cmake -S . -B build-fuzz -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DDFLASH_CUDA=OFF \
  -DDFLASH_TESTS=OFF -DDFLASH_FUZZ=ON -DDFLASH_SANITIZE=address,undefined >/dev/null
targets=(safetensors_fuzz gguf_fuzz config_json_fuzz tokenizer_json_fuzz chat_data_fuzz)
cmake --build build-fuzz -j "$jobs" --target "${targets[@]}"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
seed() {  # seed TARGET FILES...: copies the files into the target's corpus
  local t=$1; shift
  mkdir -p "$work/$t"
  for f in "$@"; do [ -f "$f" ] && [ "$(stat -c %s "$f")" -le 65536 ] && cp "$f" "$work/$t/$(echo "$f" | tr / _)"; done
  return 0
}
for t in "${targets[@]}"; do seed "$t" fuzz/regressions/"$t"/*; done  # inputs that once failed run first
seed safetensors_fuzz tests/fixtures/*/*.safetensors tests/fixtures/drafter/init/model.safetensors
seed gguf_fuzz fuzz/seeds/gguf/*
seed config_json_fuzz tests/fixtures/*/config.json tests/fixtures/drafter/init/config.json
seed tokenizer_json_fuzz fuzz/seeds/tokenizer_json/*
seed chat_data_fuzz fuzz/seeds/chat_data/*

status=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/crashes/$t"
  echo "fuzz: $t for ${secs}s (corpus: $(ls "$work/$t" | wc -l) seeds)"
  if ! UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
       "build-fuzz/$t" "$work/$t" -max_total_time="$secs" -seed="${FUZZ_SEED:-1}" -max_len=65536 -timeout=20 -rss_limit_mb=4096 \
       -artifact_prefix="fuzz/crashes/$t/" -print_final_stats=1 >"$work/$t.log" 2>&1; then
    echo "fuzz: $t FAILED; the input is in fuzz/crashes/$t/:"
    grep -E "ERROR|SUMMARY|runtime error|Test unit written" "$work/$t.log" | head -n 10
    status=1
  else
    grep -E "stat::number_of_executed_units|cov: " "$work/$t.log" | tail -n 2 | tr '\n' ' '
    echo
  fi
  rmdir "fuzz/crashes/$t" 2>/dev/null || true
done
exit $status
