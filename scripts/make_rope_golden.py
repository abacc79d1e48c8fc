#!/usr/bin/env python3
"""Golden RoPE frequencies from transformers, for tests/ops/ops_test.cpp (RopeFrequenciesMatchTransformers).

Where it runs: the GPU machine (transformers 5.17, torch; no network); CPU only. For each case it builds
a Qwen3Config with the case's rope scaling, asks transformers' own ROPE_INIT_FUNCTIONS for the inverse
frequencies and the attention scaling, and writes them with the case to OUT (default
tests/fixtures/rope/golden.json).

Usage: python3 scripts/make_rope_golden.py [OUT]
"""
import json
import sys

import torch
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

# (head_dim, max_position_embeddings, rope_theta, rope_scaling)
CASES = [
    (128, 262144, 1e7, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 65536}),
    (128, 131072, 1e6, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768,
                        "beta_fast": 16.0, "beta_slow": 2.0}),
    (64, 40960, 1e6, {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096,
                      "attention_factor": 1.25, "truncate": False}),
    (128, 163840, 1e4, {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                        "mscale": 1.0, "mscale_all_dim": 0.707}),
    (128, 131072, 5e5, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192}),
]


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/rope/golden.json"
    cases = []
    for head_dim, max_pos, theta, scaling in CASES:
        cfg = Qwen3Config(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                          max_position_embeddings=max_pos, rope_theta=theta, rope_scaling=dict(scaling))
        params = dict(cfg.rope_parameters)
        inv_freq, attention = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, torch.device("cpu"))
        cases.append({"head_dim": head_dim, "max_position_embeddings": max_pos, "rope_theta": theta,
                      "rope_scaling": scaling, "rope_parameters_seen": {k: v for k, v in params.items()},
                      "inv_freq": [float(x) for x in inv_freq.to(torch.float32).tolist()],
                      "attention_factor": float(attention)})
    with open(out, "w") as f:
        json.dump({"transformers": __import__("transformers").__version__, "cases": cases}, f, indent=1)
    print(f"wrote {len(cases)} cases to {out}")


if __name__ == "__main__":
    main()
