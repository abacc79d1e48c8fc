#!/usr/bin/env python3
"""Writes a small dflash-packed-v1 training directory of synthetic samples (for smoke runs of
`dflash train` on tiny fixture targets, where no tokenizer exists): each sample is a random 8-token
"prompt" without loss followed by a "response" that follows a fixed rule (next = 7 * prev + 3 mod
VOCAB-1), which a drafter can learn. Plain Python (no numpy needed).

Usage: scripts/make_synthetic_data.py OUT_DIR [--samples 12] [--vocab 301] [--seed 0]
"""
import argparse
import json
import os
import random
import struct


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--samples", type=int, default=12)
    ap.add_argument("--vocab", type=int, default=301)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    os.makedirs(a.out)
    ids, mask, offs = [], [], [0]
    for _ in range(a.samples):
        n = rng.randrange(20, 40)
        s = []
        for j in range(n):
            s.append(rng.randrange(a.vocab - 1) if j < 8 else (s[-1] * 7 + 3) % (a.vocab - 1))
        ids += s
        mask += [0] * 8 + [1] * (n - 8)
        offs.append(len(ids))
    with open(os.path.join(a.out, "tokens.i32"), "wb") as f:
        f.write(struct.pack(f"<{len(ids)}i", *ids))
    with open(os.path.join(a.out, "loss_mask.u8"), "wb") as f:
        f.write(bytes(mask))
    with open(os.path.join(a.out, "offsets.i64"), "wb") as f:
        f.write(struct.pack(f"<{len(offs)}q", *offs))
    with open(os.path.join(a.out, "manifest.json"), "w") as f:
        json.dump({"format": "dflash-packed-v1", "num_samples": a.samples, "num_tokens": len(ids),
                   "num_loss_tokens": sum(mask), "note": "synthetic (scripts/make_synthetic_data.py)"}, f)


if __name__ == "__main__":
    main()
