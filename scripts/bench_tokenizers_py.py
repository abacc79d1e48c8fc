#!/usr/bin/env python3
"""Single-thread tokenization speed of the Python `tokenizers` library on GSM8K: the reference number that
`dflash bench tokenize` is compared against (same texts, same counting, same machine).

Texts: for each record of the JSONL file, question + "\\n" + answer (exactly what `dflash bench tokenize` uses).
Counted: tokens of encode(text, add_special_tokens=False), summed over the file; MB/s counts the UTF-8 bytes.
Modes (one thread each: TOKENIZERS_PARALLELISM=false and RAYON_NUM_THREADS=1 are set before the import):
  loop:  tk.encode(text) for each text in a Python loop (recorded as preset <name>-gsm8k-train-hf-tokenizers)
  batch: tk.encode_batch(texts) in one call (recorded as <name>-gsm8k-train-hf-tokenizers-batch)
Each mode: one warm-up pass, then --repeat timed passes; the median is recorded.
Appends one JSON line per mode to <results>/tokenize.jsonl (bench "tokenize", metric tokens_per_s; commit from
`git rev-parse --short HEAD`, device = CPU model name as src/bench/record.cpp writes it, date ISO 8601 UTC) and a
readable line to <results>/tokenize.md.

Usage: /tmp/hfenv/bin/python scripts/bench_tokenizers_py.py [--tokenizer ../shared/tokenizers/qwen3]
           [--data ../shared/data/gsm8k/train.jsonl] [--repeat 5] [--name qwen3] [--results bench/results] [--no-record]
"""

import os

os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def load_texts(path):
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                texts.append(r["question"] + "\n" + r["answer"])
    return texts


def cpu_description():
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and ":" in line:
                    name = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} threads)"


def git_commit():
    c = os.environ.get("DFLASH_COMMIT")
    if c:
        return c
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def append_record(results, rec):
    d = Path(results)
    d.mkdir(parents=True, exist_ok=True)
    # The same text as src/bench/record.cpp writes (nlohmann's compact dump with sorted keys, %.6g).
    def dump(x):
        return json.dumps(x, sort_keys=True, separators=(",", ":"), ensure_ascii=False)

    with open(d / f"{rec['bench']}.jsonl", "a") as f:
        f.write(dump(rec) + "\n")
    with open(d / f"{rec['bench']}.md", "a") as f:
        f.write(f"- {rec['date']} | {rec['preset']} | {rec['metric']} = {rec['value']:.6g} {rec['unit']} | "
                f"commit {rec['commit']} | {rec['device']} | {dump(rec['extra'])}\n")


def time_passes(fn, repeat):
    fn()  # warm-up
    secs = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        secs.append(time.perf_counter() - t0)
    return sorted(secs)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "tokenizers" / "qwen3"),
                    help="tokenizer.json or a directory holding one")
    ap.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "gsm8k" / "train.jsonl"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--name", default="qwen3", help="preset prefix")
    ap.add_argument("--results", default=str(ROOT / "bench" / "results"))
    ap.add_argument("--no-record", action="store_true")
    args = ap.parse_args()

    import tokenizers
    from tokenizers import Tokenizer

    path = Path(args.tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    tk = Tokenizer.from_file(str(path))
    texts = load_texts(args.data)
    nbytes = sum(len(t.encode("utf-8")) for t in texts)
    ntok = sum(len(e.ids) for e in tk.encode_batch(texts, add_special_tokens=False))

    def loop():
        for t in texts:
            tk.encode(t, add_special_tokens=False)

    def batch():
        tk.encode_batch(texts, add_special_tokens=False)

    for mode, fn, suffix in (("loop", loop, ""), ("batch", batch, "-batch")):
        secs = time_passes(fn, args.repeat)
        med = secs[len(secs) // 2]
        rec = {
            "bench": "tokenize",
            "preset": f"{args.name}-gsm8k-train-hf-tokenizers{suffix}",
            "metric": "tokens_per_s",
            "value": ntok / med,
            "unit": "tokens/s",
            "commit": git_commit(),
            "device": cpu_description(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
            "extra": {
                "implementation": f"python tokenizers {tokenizers.__version__} ({mode})",
                "threads": 1, "texts": len(texts), "tokens": ntok, "bytes": nbytes,
                "mb_per_s": nbytes / med / 1e6, "repeat": args.repeat, "median_s": med,
                "min_s": secs[0], "max_s": secs[-1], "data": Path(args.data).name,
                "text": "question + \\n + answer", "add_special_tokens": False,
            },
        }
        print(json.dumps(rec, sort_keys=True))
        if not args.no_record:
            append_record(args.results, rec)


if __name__ == "__main__":
    main()
