#!/usr/bin/env bash
# GPU-machine check (see DEVELOPERS' guide): runs the test suite and the CLI on an NVIDIA GPU host and
# writes a report for bench/results/. Usage on the GPU machine, from the repository root:
#   scripts/gpu_check.sh [BUILD_DIR]
# BUILD_DIR holds `dflash` and `dflash_tests`; when absent it is configured and built here with
# -DDFLASH_CUDA_ARCHITECTURES=native. The GPU machine lacks OpenBLAS, so the usual way is to build on the
# Debian dev machine with -DDFLASH_PORTABLE=ON (static deps) and carry build-portable/.
# Env: OUT (report directory, default bench/results), DFLASH_COMMIT (commit id when .git is absent),
#      DFLASH_SMOLLM2_GGUF (the real model, for the SmolLM2 tests).
set -uo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
build=${1:-build-gpu}
out=${OUT:-bench/results}
mkdir -p "$out"
commit=${DFLASH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
gpu=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null | head -n 1)
date=$(date -u +%Y-%m-%dT%H:%M:%SZ)
report="$out/gpu_check.md"
log="$out/gpu_check.log"
: > "$log"

if [ ! -x "$build/dflash_tests" ]; then
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DDFLASH_CUDA_ARCHITECTURES=native >>"$log" 2>&1
  cmake --build "$build" -j >>"$log" 2>&1 || { echo "gpu_check: build failed, see $log"; exit 1; }
fi

# cuBLASLt and NCCL are linked dynamically: find the toolkit's (or the CUDA wheels') copy when the
# RPATH misses it.
for lib in libcublasLt.so.13 libnccl.so.2; do
  if ldd "$build/dflash_tests" 2>/dev/null | grep -q "$lib => not found"; then
    lt=$(find /usr/local /opt /usr/lib -name "$lib" 2>/dev/null | head -n 1)
    [ -n "$lt" ] && export LD_LIBRARY_PATH="$(dirname "$lt")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done

case "$build" in /*) bin_dir="$build" ;; *) bin_dir="$root/$build" ;; esac  # BUILD_DIR absolute or relative
export DFLASH_SOURCE_DIR="$root" DFLASH_BINARY="$bin_dir/dflash"
"$build/dflash_tests" --gtest_brief=1 >"$out/gpu_tests.log" 2>&1
tests_rc=$?
summary=$(grep -E '^\[  (PASSED|FAILED)  \]|tests? ran|SKIPPED \]' "$out/gpu_tests.log" | head -n 5)
gpu_tests=$("$build/dflash_tests" --gtest_filter='Cuda*:*PyTorch*' 2>&1 | grep -E '^\[ +(OK|FAILED|SKIPPED) +\]|^\[[a-z]' | head -n 60)
# The GPU kernel tests once more under compute-sanitizer memcheck (out-of-bounds, misaligned, leaks);
# not CudaGpuPower, whose GEMM loop must draw near the power limit (instrumented kernels do not), nor
# the refused-allocation test (the sanitizer reports the out-of-memory it provokes as an API error).
memcheck="compute-sanitizer not found"
if command -v compute-sanitizer >/dev/null; then
  compute-sanitizer --tool memcheck --leak-check full --error-exitcode 9 "$build/dflash_tests" \
    --gtest_filter='Cuda*:-CudaDataParallel*:CudaMultiProcess*:CudaGpuPower*:CudaRuntime.Refused*' --gtest_brief=1 \
    >"$out/memcheck.log" 2>&1
  mc_rc=$?
  memcheck="exit $mc_rc ($(grep -E 'ERROR SUMMARY|PASSED|FAILED' "$out/memcheck.log" | tr '\n' ' '))"
  [ $mc_rc -ne 0 ] && tests_rc=1
  # Shared-memory races, barrier misuse and uninitialized reads in the GatedDeltaNet and attention kernels (tools
  # memcheck does not cover).
  for tool in racecheck synccheck initcheck; do
    compute-sanitizer --tool "$tool" --error-exitcode 9 "$build/dflash_tests" --gtest_filter='CudaGdn*:CudaMaskedAttention*' --gtest_brief=1 \
      >"$out/$tool.log" 2>&1
    rc=$?
    memcheck+="; $tool exit $rc ($(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|PASSED|FAILED' "$out/$tool.log" | tr '\n' ' '))"
    [ $rc -ne 0 ] && tests_rc=1
  done
fi
inspect=$("$build/dflash" inspect tests/fixtures/qwen3_5 2>&1 | sed -n '1,20p')
inspect_dense=$("$build/dflash" inspect tests/fixtures/qwen3_hd64 2>&1 | sed -n '/^devices/,$p')
inspect_moe=$("$build/dflash" inspect tests/fixtures/qwen3_next_hd64 2>&1 | sed -n '/^experts/p;/^devices/,$p')
# dflash train on one GPU vs the CPU reference: same tiny target (qwen3_hd64), same synthetic data,
# same seed; the loss curves should agree to bf16 noise.
train_cmp=""
sd=$(mktemp -d)
if python3 scripts/make_synthetic_data.py "$sd/data" >>"$log" 2>&1; then
  for dev in cpu cuda; do
    "$build/dflash" train --target tests/fixtures/qwen3_hd64 --data "$sd/data" --out "$sd/$dev" --device "$dev" \
      --mask-token-id 300 --num-taps 1 --num-draft-layers 2 --block-size 4 --num-anchors 8 --max-steps 60 \
      --lr 3e-3 --log-every 20 --stages-every 60 >"$sd/$dev.log" 2>&1 || tests_rc=1
    train_cmp+="--- $dev"$'\n'"$(grep -E '^(step|stages|gpu power|train: done)' "$sd/$dev.log")"$'\n'
  done
fi
# Several GPUs (a machine with 2): --gpus 0 vs --gpus 0,1 (data parallel) vs target on GPU 0 and
# drafter on GPU 1 (disaggregated), 4 micro-batches per step; the loss curves should agree (data
# parallel: to fp32 summation-order noise; disaggregated: exactly).
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
dp_cmp="not run: $ngpu GPU(s) visible (needs 2)"
if [ "$ngpu" -ge 2 ] && [ -d "$sd/data" ]; then
  dp_cmp=""
  i=0
  for place in "--gpus 0" "--gpus 0,1" "--target-gpus 0 --drafter-gpus 1"; do
    i=$((i + 1))
    # shellcheck disable=SC2086  # $place is a list of flags
    "$build/dflash" train --target tests/fixtures/qwen3_hd64 --data "$sd/data" --out "$sd/dp$i" --device cuda $place \
      --mask-token-id 300 --num-taps 1 --num-draft-layers 2 --block-size 4 --num-anchors 8 --max-steps 30 \
      --grad-accum 4 --lr 3e-3 --log-every 10 --stages-every 30 >"$sd/dp$i.log" 2>&1 || tests_rc=1
    dp_cmp+="--- $place"$'\n'"$(grep -E '^(step|stages|gpu power|train: done)|device cuda' "$sd/dp$i.log" | head -n 12)"$'\n'
  done
fi
# Two processes started by mpirun (Open MPI), one GPU each: the same run as --gpus 0,1 in one process.
mpi_run="not run: needs 2 GPUs and mpirun"
if [ "$ngpu" -ge 2 ] && command -v mpirun >/dev/null && [ -d "$sd/data" ]; then
  mpirun --allow-run-as-root --oversubscribe -np 2 -x DFLASH_MASTER_PORT=29612 "$build/dflash" train \
    --target tests/fixtures/qwen3_hd64 --data "$sd/data" --out "$sd/mpi" --device cuda --gpus 0 \
    --mask-token-id 300 --num-taps 1 --num-draft-layers 2 --block-size 4 --num-anchors 8 --max-steps 30 \
    --grad-accum 4 --lr 3e-3 --log-every 10 --stages-every 30 >"$sd/mpi.log" 2>&1 || tests_rc=1
  mpi_run=$(grep -E '^(train: process|step|stages|gpu power|train: done)' "$sd/mpi.log" | head -n 12)
  [ -n "$mpi_run" ] || mpi_run=$(tail -n 20 "$sd/mpi.log")
fi
rm -rf "$sd"

# Drafter training step benchmarks (random weights, published shapes); appended to $out/drafter-step.*
bench=""
clocks="not sampled (benchmarks off, or no nvidia-smi)"
if [ "${GPU_CHECK_BENCH:-1}" != 0 ] && command -v nvidia-smi >/dev/null; then
  # GPU 0's SM clock, power and clock-limit reasons every 200 ms while the benchmarks run: under a
  # power cap the clocks, not the kernels, set the pace.
  nvidia-smi -i 0 --query-gpu=clocks.sm,power.draw,power.limit,clocks_throttle_reasons.active --format=csv,noheader,nounits \
    -lms 200 >"$out/clocks.csv" 2>/dev/null &
  smi_pid=$!
fi
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  for p in qwen3-8b qwen3.6-27b; do
    DFLASH_COMMIT="$commit" "$build/dflash" bench drafter-step --preset "$p" --results "$out" >>"$log" 2>&1 || tests_rc=1
  done
  bench=$(tail -n 4 "$out/drafter-step.md" 2>/dev/null)
  # The GatedDeltaNet kernels and the Qwen3.6-27B hybrid target forward (random weights).
  DFLASH_COMMIT="$commit" "$build/dflash" bench gdn --results "$out" >>"$log" 2>&1 || tests_rc=1
  # ... and the Qwen3.6-35B-A3B mixture-of-experts target (256 experts, top 8).
  for p in qwen3.6-27b qwen3.6-35b-a3b; do
    DFLASH_COMMIT="$commit" "$build/dflash" bench target-forward --device cuda --preset "$p" --results "$out" \
      >>"$log" 2>&1 || tests_rc=1
  done
  # FP8 targets: the forward's speed beside bf16's above, and the taps' and logits' relative L2 against
  # the bf16 target at the preset shapes (fp8_vs_bf16_rel_l2 in the record).
  for p in qwen3.6-27b qwen3-8b; do
    DFLASH_COMMIT="$commit" "$build/dflash" bench target-forward --device cuda --preset "$p" --target-dtype fp8 \
      --results "$out" >>"$log" 2>&1 || tests_rc=1
  done
  # Batch decoding of the 27B against its memory-bandwidth bound (the engine of eval and regeneration).
  for dt in bf16 fp8; do
    DFLASH_COMMIT="$commit" "$build/dflash" bench decode --preset qwen3.6-27b --batch 1,16,64 --new-tokens 128 \
      --target-dtype "$dt" --results "$out" >>"$log" 2>&1 || tests_rc=1
  done
  bench+=$'\n'"$(tail -n 3 "$out/gdn.md" 2>/dev/null)"$'\n'"$(tail -n 6 "$out/target-forward.md" 2>/dev/null)"
  bench+=$'\n'"$(tail -n 6 "$out/decode.md" 2>/dev/null)"
fi
# The training pipeline of one sample (target taps + drafter step, colocated on one GPU): the tiny
# smoke run always (printed, not recorded); qwen3-8b with the benchmarks (appended to $out/pipeline.*).
pipeline="--- tiny (not recorded)"$'\n'
pipeline+=$(DFLASH_COMMIT="$commit" "$build/dflash" bench pipeline --preset tiny --steps 3 --warmup 1 --no-record 2>&1) || tests_rc=1
# Colocated, the 27B target and its drafter step peak at 99.8 GB (the H200 record): not on a smaller GPU.
mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
fits() { [ "$1" != qwen3.6-27b ] || [ "${mem_mib:-0}" -ge 110000 ]; }
too_small="not run: colocated, the qwen3.6-27b target and drafter step peak at 99.8 GB; this GPU has ${mem_mib:-?} MiB"
if [ "${GPU_CHECK_BENCH:-1}" != 0 ]; then
  for p in qwen3-8b qwen3.6-27b; do
    if ! fits "$p"; then pipeline+=$'\n'"--- $p"$'\n'"$too_small"; continue; fi
    pp=$(DFLASH_COMMIT="$commit" "$build/dflash" bench pipeline --preset "$p" --results "$out" 2>&1) || tests_rc=1
    echo "$pp" >>"$log"
    pipeline+=$'\n'"--- $p"$'\n'"$pp"
  done
  # With the FP8 target the colocated 27B pair fits 80 GB (the goal: >= 2.2 samples/s on an H200).
  pp=$(DFLASH_COMMIT="$commit" "$build/dflash" bench pipeline --preset qwen3.6-27b --target-dtype fp8 --results "$out" 2>&1) || tests_rc=1
  echo "$pp" >>"$log"
  pipeline+=$'\n'"--- qwen3.6-27b, --target-dtype fp8"$'\n'"$pp"
  # The dflash train path (trainer + GPU backend) on 1 and 2 GPUs, colocated (2 samples per replica
  # per step): the speedup of the second GPU.
  if [ "$ngpu" -ge 2 ]; then
    for p in qwen3-8b qwen3.6-27b; do
      for g in 0 0,1; do
        if ! fits "$p"; then pipeline+=$'\n'"--- $p, train path, --gpus $g"$'\n'"$too_small"; continue; fi
        pg=$(DFLASH_COMMIT="$commit" "$build/dflash" bench pipeline --preset "$p" --gpus "$g" --steps 6 --warmup 2 \
          --results "$out" 2>&1) || tests_rc=1
        echo "$pg" >>"$log"
        pipeline+=$'\n'"--- $p, train path, --gpus $g"$'\n'"$(echo "$pg" | grep samples_per_s)"
      done
    done
  fi
fi
if [ -n "${smi_pid:-}" ]; then
  kill "$smi_pid" 2>/dev/null
  # Samples drawing more than 300 W (the benchmarks at work, not the gaps between them).
  clocks=$(awk -F', ' '$2 + 0 > 300 { n++; c += $1; p += $2; lim = $3; if (min == "" || $1 + 0 < min) min = $1 + 0;
      if ($4 != "0x0000000000000000") capped++ }
    END { if (n) printf "%d samples over 300 W: SM clock mean %.0f MHz (min %d), power mean %.0f W of a %.0f W limit, clocks limited in %d%% of them (nvidia-smi clocks_event_reasons)", n, c / n, min, p / n, lim, 100 * capped / n;
          else print "no sample over 300 W" }' "$out/clocks.csv")
fi
smol="not run (DFLASH_SMOLLM2_GGUF unset)"
if [ -n "${DFLASH_SMOLLM2_GGUF:-}" ]; then
  smol=$("$build/dflash" inspect "$DFLASH_SMOLLM2_GGUF" 2>&1 | sed -n '1,14p')
fi

{
  echo "# GPU check: $date"
  echo
  echo "- commit: $commit"
  echo "- device: ${gpu:-no GPU visible}"
  echo "- build: $build ($(file -b "$build/dflash" 2>/dev/null | cut -d, -f1-2))"
  echo "- test suite exit status: $tests_rc"
  echo
  echo '## Test summary'
  echo '```'
  echo "$summary"
  echo '```'
  echo '## GPU tests (tests/*/cuda, vs the CPU references)'
  echo '```'
  echo "$gpu_tests"
  echo '```'
  echo "compute-sanitizer memcheck of the GPU kernel tests: $memcheck"
  echo
  echo '## dflash inspect tests/fixtures/qwen3_5 (device detection)'
  echo '```'
  echo "$inspect"
  echo '```'
  echo '## dflash inspect tests/fixtures/qwen3_hd64 (a model the GPU backend runs)'
  echo '```'
  echo "$inspect_dense"
  echo '```'
  echo '## dflash inspect tests/fixtures/qwen3_next_hd64 (mixture of experts on the GPU)'
  echo '```'
  echo "$inspect_moe"
  echo '```'
  echo '## dflash train: --device cuda vs the CPU reference (qwen3_hd64 target, synthetic data, 60 steps)'
  echo '```'
  echo "$train_cmp"
  echo '```'
  echo '## dflash train on one GPU, data parallel on two, disaggregated (grad-accum 4, qwen3_hd64 target, 30 steps)'
  echo '```'
  echo "$dp_cmp"
  echo '```'
  echo '## mpirun -np 2 dflash train --gpus 0 (two processes, one GPU each; compare with --gpus 0,1 above)'
  echo '```'
  echo "$mpi_run"
  echo '```'
  echo '## dflash bench drafter-step (one step = zero_grads + forward + backward + clip + AdamW)'
  echo '```'
  echo "$bench"
  echo '```'
  echo "GPU clocks during the benchmarks: $clocks"
  echo
  echo '## dflash bench pipeline (one sample = target forward_taps + drafter training step, one GPU)'
  echo '```'
  echo "$pipeline"
  echo '```'
  echo '## dflash inspect SmolLM2-135M-Instruct (Q4_1 GGUF)'
  echo '```'
  echo "$smol"
  echo '```'
} >"$report"
cat "$report"
exit $tests_rc
