#!/usr/bin/env python3
"""The transformers side of `dflash bench target-forward --device cuda`: the same target shape with
random bf16 weights, one forward of T random tokens with the lm_head (batch 1, no cache), timed with
CUDA events (median of the timed runs after warm-up). Prints one JSON record per run.

Presets (shapes as in src/bench/presets.cpp):
  qwen3.6-35b-a3b  Qwen3_5MoeForCausalLM with transformers' Qwen3_5MoeTextConfig defaults (35B-A3B)

GatedDeltaNet runs through flash-linear-attention when it imports (say `--require-fla` to insist),
else through transformers' PyTorch fallback; the record says which, and which experts implementation
(config._experts_implementation) ran. Runs on the GPU machine (torch, transformers 5.17).
Usage: python3 scripts/bench_transformers_target.py --preset qwen3.6-35b-a3b [--tokens 4096] [--layers N]
"""
import argparse
import json
import statistics
import time

import torch


def build(preset, layers):
    if preset != "qwen3.6-35b-a3b":
        raise SystemExit(f"unknown preset {preset}")
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    cfg = Qwen3_5MoeTextConfig()
    shape = {k: getattr(cfg, k) for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size",
        "vocab_size")}
    if layers:
        cfg.num_hidden_layers = layers
        cfg.layer_types = cfg.layer_types[:layers]
    return Qwen3_5MoeForCausalLM, cfg, shape


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3.6-35b-a3b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--layers", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--require-fla", action="store_true")
    a = ap.parse_args()
    try:
        import fla  # noqa: F401
        fla_version = getattr(fla, "__version__", "present")
    except ImportError:
        fla_version = None
    if a.require_fla and not fla_version:
        raise SystemExit("flash-linear-attention does not import")
    cls, cfg, shape = build(a.preset, a.layers)
    torch.manual_seed(0)
    t0 = time.time()
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = cls(cfg).eval()
    torch.set_default_dtype(torch.float32)
    build_s = time.time() - t0
    mlp = model.model.layers[0].mlp  # initialized weights spread the routing as a trained router would
    init_std = {"router": mlp.gate.weight.float().std().item(), "experts_gate_up": mlp.experts.gate_up_proj.float().std().item()}
    ids = torch.randint(0, cfg.vocab_size, (1, a.tokens), device="cuda")
    times = []
    with torch.no_grad():
        for r in range(a.warmup + a.repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            model(input_ids=ids, use_cache=False)
            end.record()
            torch.cuda.synchronize()
            if r >= a.warmup:
                times.append(start.elapsed_time(end))
    ms = statistics.median(times)
    import transformers

    print(json.dumps({
        "bench": "target-forward", "preset": a.preset + (f"-{a.layers}layers" if a.layers else "") + "-transformers",
        "metric": "tokens_per_s", "value": a.tokens / (ms / 1e3), "unit": "tokens/s",
        "device": torch.cuda.get_device_name(), "extra": {
            "tokens": a.tokens, "forward_ms": ms, "runs_ms": times, "layers": cfg.num_hidden_layers,
            "shape": shape, "flash_linear_attention": fla_version,
            "experts_implementation": getattr(cfg, "_experts_implementation", None),
            "attn_implementation": getattr(cfg, "_attn_implementation", None),
            "init_std": init_std, "transformers": transformers.__version__, "torch": torch.__version__, "build_s": build_s,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9,
            "what": "transformers forward with lm_head, random bf16 weights, batch 1, no cache; CUDA events"}}))


if __name__ == "__main__":
    main()
