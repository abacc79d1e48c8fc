#!/usr/bin/env python3
"""Build the tiny real-format checkpoints and transformers golden outputs under tests/fixtures.

Where it runs: the GPU machine (Python 3.12, torch 2.11, transformers 5.17, no network). Everything is
computed on the CPU (no TF32, one thread, deterministic algorithms), so the goldens do not depend on
the GPU. Weights are float32; the goldens are the same model run in float64 (see run_exact), so that
they measure the C++ reference's error and not transformers' own fp32 rounding.

What it writes (one directory per model, each made from scratch):
  llama/         LlamaForCausalLM, GQA 3, head_dim 10, untied lm_head, single model.safetensors
  qwen3_hd64/    Qwen3ForCausalLM with head_dim 64 (GQA 2, 2 layers, untied): the GPU kernels' smallest head size
  qwen3/         Qwen3ForCausalLM, head_dim 16 != hidden/heads, q/k norms, TIED embeddings (no lm_head.weight
                 in the files), saved SHARDED (model.safetensors.index.json + 2-4 shards)
  qwen3_5_text/  Qwen3_5ForCausalLM (model_type qwen3_5_text), layer_types
                 [lin, full, lin, lin, full], partial RoPE 0.25, GDN Hv/Hk = 3
  qwen3_5/       Qwen3_5ForConditionalGeneration (model_type qwen3_5): weights under model.language_model.*,
                 model.visual.* (tiny vision tower), lm_head.weight, plus a fake mtp.fc.weight that loaders
                 must ignore
  qwen3_5_moe/    Qwen3_5MoeForConditionalGeneration: the wrapper with a mixture-of-experts FFN in every layer
                 (6 experts, top 2, renormalized, a shared expert)
  qwen3_next/     Qwen3NextForCausalLM: fused in_proj_qkvz / in_proj_ba, experts in layers 0 and 2, a dense
                 MLP in layer 1 (mlp_only_layers), router without renormalization, 1-D RoPE
  qwen3_5_moe_hd64/, qwen3_next_hd64/  the two MoE fixtures above with attention head_dim 64 and 8 experts
                 (top 3): the GPU MoE path; made like the *_hd64 fixtures below (half gain, stacked experts
                 scaled like linear layers, golden_bf16_weights.safetensors).
  qwen3_5_text_hd64/, qwen3_5_hd64/  the two Qwen3.5 formats above with attention head_dim 64 (the GPU
                 attention kernels' smallest) and GatedDeltaNet heads dk 32 / dv 40, GVA 2: the GPU hybrid path.
                 Linear layers at half gain (BF16_LINEAR_GAIN). They also get golden_bf16_weights.safetensors
                 (same keys as golden.safetensors): the exact (float64) forward of the model with the weights
                 the GPU holds, every matrix except conv1d rounded to bfloat16, so that the GPU's own error is
                 measured apart from the weights'.
Each directory gets config.json, the safetensors weights (float32), and golden.safetensors with, for
sequences i = 0, 1, 2 of lengths 1, 37, 100 (random ids, fixed seed), each run ALONE (batch 1, no padding,
no attention mask, no cache):
  seq{i}.input_ids          int64   [T]
  seq{i}.logits             float32 [T, V]
  seq{i}.hidden_states.{j}  float32 [T, D]   j = 0..L, exactly transformers' output_hidden_states:
                            j = 0 embeddings, j = k+1 output of layer k, j = L AFTER the final norm
  seq{i}.last_layer_output  float32 [T, D]   raw output of the last decoder layer (before the final norm)
and metadata num_layers, num_sequences, seq_lens, last_hidden_state ("final_norm"), versions, seeds.
A packed-batch golden is the concatenation of the per-sequence goldens (the C++ test packs them itself);
transformers is never run on a packed batch (its GatedDeltaNet fallback would leak state across sequences).

Checks (exit status 1 if any fails): saved key layout per format, float32 everywhere, shard count, tied /
untied lm_head, reload with from_pretrained is bit-identical to the in-memory model, output_hidden_states
layout, logits == lm_head(last hidden state), causality (prefix of the 100-token run == 37-token run).

Usage: python3 scripts/make_fixtures.py [--out tests/fixtures] [--models llama,qwen3,qwen3_5_text,qwen3_5]
"""

import argparse
import copy
import json
import math
import os
import shutil
import sys
import traceback
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

SEQ_LENS = (1, 37, 100)
WEIGHT_SEED = 20240611
IDS_SEED = 777
MAX_DIR_BYTES = 1_500_000  # hard limit per model directory (the goal is ~1 MB or less)

LIN, FULL = "linear_attention", "full_attention"


class CheckFailed(Exception):
    pass


def check(cond, msg):
    if not cond:
        raise CheckFailed(msg)


# --------------------------------------------------------------------------------------------------
# model definitions
# --------------------------------------------------------------------------------------------------

def build_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=301,
        hidden_size=60,
        intermediate_size=94,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=10,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        attn_implementation="eager",
    )
    return LlamaForCausalLM, cfg


def build_qwen3():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # NB: do not pass layer_types (some 5.x Qwen3Config versions skip rope standardization when it is given).
    cfg = Qwen3Config(
        vocab_size=301,
        hidden_size=60,
        intermediate_size=94,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        use_sliding_window=False,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM, cfg


def build_qwen3_hd64():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    # head_dim 64: the smallest head size the GPU attention kernels take (tests/models/cuda/target_gpu_test.cpp)
    cfg = Qwen3Config(
        vocab_size=301,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=False,
        attention_bias=False,
        use_sliding_window=False,
        attn_implementation="eager",
    )
    return Qwen3ForCausalLM, cfg


def qwen35_text_kwargs(*, vocab, hidden, inter, layer_types, heads, kv_heads, head_dim, lk_heads, lv_heads,
                       lk_dim, lv_dim, mrope_section):
    rotary_dim = int(head_dim * 0.25)
    check(rotary_dim % 2 == 0, f"rotary dim {rotary_dim} must be even")
    check(sum(mrope_section) == rotary_dim // 2, f"mrope_section {mrope_section} must sum to {rotary_dim // 2}")
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        hidden_act="silu",
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000000.0,
            "partial_rotary_factor": 0.25,
            "mrope_section": list(mrope_section),
            "mrope_interleaved": True,
        },
        partial_rotary_factor=0.25,
        linear_conv_kernel_dim=4,
        linear_key_head_dim=lk_dim,
        linear_value_head_dim=lv_dim,
        linear_num_key_heads=lk_heads,
        linear_num_value_heads=lv_heads,
        attention_bias=False,
        tie_word_embeddings=False,
    )


def build_qwen3_5_text():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    kw = qwen35_text_kwargs(
        vocab=299, hidden=52, inter=70, layer_types=[LIN, FULL, LIN, LIN, FULL], heads=4, kv_heads=2,
        head_dim=16, lk_heads=2, lv_heads=6, lk_dim=8, lv_dim=12,
        mrope_section=[1, 1, 0],  # rotary_dim 4 -> 2 frequencies
    )
    cfg = Qwen3_5TextConfig(**kw, attn_implementation="eager")
    return Qwen3_5ForCausalLM, cfg


def build_qwen3_5():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    # head_dim 24 (not 12): partial_rotary_factor 0.25 must give an EVEN rotary dim (24 -> 6, 3 frequencies).
    text = qwen35_text_kwargs(
        vocab=263, hidden=44, inter=58, layer_types=[LIN, LIN, FULL, LIN], heads=4, kv_heads=1,
        head_dim=24, lk_heads=2, lv_heads=4, lk_dim=8, lv_dim=10,
        mrope_section=[1, 1, 1],
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        in_channels=3,
        patch_size=2,
        temporal_patch_size=2,
        spatial_merge_size=2,
        out_hidden_size=44,
        num_position_embeddings=16,  # a 4x4 learned grid
    )
    cfg = Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=False,
                        attn_implementation="eager")
    return Qwen3_5ForConditionalGeneration, cfg


def hd64_text_kwargs():
    return qwen35_text_kwargs(
        vocab=256, hidden=48, inter=64, layer_types=[LIN, FULL, LIN, LIN], heads=2, kv_heads=1,
        head_dim=64, lk_heads=2, lv_heads=4, lk_dim=32, lv_dim=40,
        mrope_section=[3, 3, 2],  # rotary_dim 16 -> 8 frequencies
    )


def build_qwen3_5_text_hd64():
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM, Qwen3_5TextConfig(**hd64_text_kwargs(), attn_implementation="eager")


def build_qwen3_5_hd64():
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    cfg = Qwen3_5Config(text_config=hd64_text_kwargs(), vision_config=vision, tie_word_embeddings=False,
                        attn_implementation="eager")
    return Qwen3_5ForConditionalGeneration, cfg


def moe_text_kwargs(**extra):
    """A small Qwen3.5-shaped text config with a mixture-of-experts FFN (6 experts, top 2, a shared
    expert); `extra` adds or overrides fields."""
    kw = qwen35_text_kwargs(
        vocab=200, hidden=40, inter=56, layer_types=[LIN, FULL, LIN], heads=2, kv_heads=1,
        head_dim=16, lk_heads=2, lv_heads=4, lk_dim=8, lv_dim=12,
        mrope_section=[1, 1, 0],  # rotary_dim 4 -> 2 frequencies
    )
    kw.update(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=32)
    kw.update(extra)
    if kw["head_dim"] == 64:  # rotary 16: 8 frequencies
        kw["rope_parameters"]["mrope_section"] = [3, 3, 2]
    return kw


def build_qwen3_5_moe(**extra):
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    text = moe_text_kwargs(**extra)
    del text["intermediate_size"]  # Qwen3_5MoeTextConfig has none: every layer is sparse
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3, patch_size=2,
                  temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=40, num_position_embeddings=16)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           attn_implementation="eager")
    return Qwen3_5MoeForConditionalGeneration, cfg


def build_qwen3_next(**extra):
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    # Layer 1 keeps the dense MLP (mlp_only_layers); the router does not renormalize (norm_topk_prob
    # False: the other branch of the Qwen3.5-MoE router); plain 1-D RoPE.
    kw = moe_text_kwargs(mlp_only_layers=[1], norm_topk_prob=False, decoder_sparse_step=1, **extra)
    kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.25}
    return Qwen3NextForCausalLM, Qwen3NextConfig(**kw, attn_implementation="eager")


# The GPU MoE fixtures: attention head_dim 64, 8 experts of which 3 per token
# (the GPU grouped GEMM's widths are multiples of 8: hidden 40, experts 24, shared expert 32).
MOE_HD64 = dict(head_dim=64, num_experts=8, num_experts_per_tok=3)


def build_qwen3_5_moe_hd64():
    return build_qwen3_5_moe(**MOE_HD64)


def build_qwen3_next_hd64():
    return build_qwen3_next(**MOE_HD64)


BF16_WEIGHT_GOLDENS = ("qwen3_5_text_hd64", "qwen3_5_hd64", "qwen3_5_moe_hd64", "qwen3_next_hd64")
# The GPU hybrid fixtures' linear layers have half the unit gain: with gain 1, four random layers amplify
# rounding so much that a CPU emulation of bf16 GEMM inputs (bf16 weights, fp32 elsewhere) already
# moves the logits by 1.6% against the exact forward of the same bf16 weights, and no bf16 path can be
# told from a wrong one at the 1e-2 bound. Layers that write smaller updates to the residual stream, as
# trained models do, keep the bound meaningful.
BF16_LINEAR_GAIN = 0.5
TEXT_ONLY = ("llama", "qwen3", "qwen3_hd64", "qwen3_5_text", "qwen3_5_text_hd64", "qwen3_next", "qwen3_next_hd64")
WRAPPERS = ("qwen3_5", "qwen3_5_hd64", "qwen3_5_moe", "qwen3_5_moe_hd64")


MODELS = {
    "llama": build_llama,
    "qwen3": build_qwen3,
    "qwen3_hd64": build_qwen3_hd64,
    "qwen3_5_text": build_qwen3_5_text,
    "qwen3_5": build_qwen3_5,
    "qwen3_5_text_hd64": build_qwen3_5_text_hd64,
    "qwen3_5_hd64": build_qwen3_5_hd64,
    "qwen3_5_moe": build_qwen3_5_moe,
    "qwen3_next": build_qwen3_next,
    "qwen3_5_moe_hd64": build_qwen3_5_moe_hd64,
    "qwen3_next_hd64": build_qwen3_next_hd64,
}


# --------------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------------

def text_config_of(model):
    cfg = model.config
    return getattr(cfg, "text_config", None) or cfg


def text_backbone(model):
    """The module that owns embed_tokens / layers / norm."""
    inner = model.model
    lm = getattr(inner, "language_model", None)
    return lm if lm is not None else inner


def force_eager(model):
    if getattr(model.config, "_attn_implementation", None) != "eager" and hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation("eager")
    impl = getattr(model.config, "_attn_implementation", None)
    check(impl == "eager", f"attention implementation is {impl!r}, wanted 'eager'")


def is_tied(model):
    emb = model.get_input_embeddings().weight
    return model.lm_head.weight is emb or model.lm_head.weight.data_ptr() == emb.data_ptr()


@torch.no_grad()
def nasty_init(model, seed, linear_gain=1.0, experts_as_linear=False):
    """Re-initialize every parameter (see the module docstring of the brief):
    Linear weights linear_gain*randn/sqrt(in), biases randn*0.2, embeddings randn*0.5, plain RMSNorm 1+0.3*randn,
    zero-centered (Qwen3.5) RMSNorm 0.3*randn, GDN gated norm 1+0.3*randn, A_log log(U(0.5, 8)),
    dt_bias randn*0.5, GDN conv1d randn*0.3, LayerNorm w 1+0.3*randn b 0.2*randn, anything else randn*0.2."""
    g = torch.Generator().manual_seed(seed)
    modules = dict(model.named_modules())
    counts = {}

    def randn(shape):
        return torch.randn(shape, generator=g, dtype=torch.float32)

    for name, p in model.named_parameters():  # tied parameters appear once (under their first name)
        mod_name, _, pname = name.rpartition(".")
        mod = modules[mod_name]
        cls = type(mod).__name__
        shape = tuple(p.shape)
        if "RMSNorm" in cls:
            initial_zero = bool((p == 0).all())
            if "Gated" in cls:
                kind, val = "gated_norm(1+0.3n)", 1.0 + 0.3 * randn(shape)
            elif cls.startswith("Qwen3_5") or cls.startswith("Qwen3Next"):
                check(initial_zero, f"{name}: {cls} expected zero-initialized (zero-centered norm)")
                kind, val = "zc_norm(0.3n)", 0.3 * randn(shape)
            else:
                check(not initial_zero, f"{name}: {cls} expected a plain (ones-initialized) norm")
                kind, val = "norm(1+0.3n)", 1.0 + 0.3 * randn(shape)
        elif isinstance(mod, torch.nn.LayerNorm):
            kind, val = ("layernorm_w", 1.0 + 0.3 * randn(shape)) if pname == "weight" else ("layernorm_b", 0.2 * randn(shape))
        elif pname == "A_log":
            kind, val = "A_log", torch.empty(shape, dtype=torch.float32).uniform_(0.5, 8.0, generator=g).log()
        elif pname == "dt_bias":
            kind, val = "dt_bias", 0.5 * randn(shape)
        elif isinstance(mod, torch.nn.Embedding):
            kind, val = "embedding(0.5n)", 0.5 * randn(shape)
        elif isinstance(mod, torch.nn.Linear):
            if pname == "weight":
                kind, val = "linear(gain*n/sqrt(in))", linear_gain * randn(shape) / math.sqrt(mod.in_features)
            else:
                kind, val = "bias(0.2n)", 0.2 * randn(shape)
        elif experts_as_linear and pname in ("gate_up_proj", "down_proj") and p.dim() == 3:
            # stacked experts [E, out, in]: each a linear map, scaled like nn.Linear
            kind, val = "experts(gain*n/sqrt(in))", linear_gain * randn(shape) / math.sqrt(shape[-1])
        elif isinstance(mod, torch.nn.Conv1d) and pname == "weight":
            kind, val = "conv1d(0.3n)", 0.3 * randn(shape)
        else:
            kind, val = "other(0.2n)", 0.2 * randn(shape)
        p.copy_(val.to(p.dtype))
        counts[kind] = counts.get(kind, 0) + 1
    return counts


def list_weight_files(d):
    d = Path(d)
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        files = sorted(set(wm.values()))
        return files, idx
    files = sorted(p.name for p in d.glob("*.safetensors") if not p.name.startswith("golden"))
    return files, None


def read_all_keys(d):
    """{key: (dtype, shape, file)} over all weight files of a saved model dir."""
    d = Path(d)
    files, _ = list_weight_files(d)
    out = {}
    for fn in files:
        with safe_open(str(d / fn), framework="pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                try:
                    dt = str(sl.get_dtype())
                except AttributeError:  # older safetensors without PySafeSlice.get_dtype
                    dt = str(f.get_tensor(k).dtype)
                out[k] = (dt, tuple(sl.get_shape()), fn)
    return out


def dir_size(d):
    return sum(p.stat().st_size for p in Path(d).rglob("*") if p.is_file())


def save_sharded(model, d, target_min=2, target_max=4):
    """save_pretrained with a max_shard_size that gives target_min..target_max shards."""
    total = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    for frac in (0.4, 0.3, 0.55, 0.26, 0.7):
        if d.exists():
            shutil.rmtree(d)
        kb = max(1, int(total * frac / 1000))
        model.save_pretrained(str(d), max_shard_size=f"{kb}KB")
        files, idx = list_weight_files(d)
        print(f"  save_pretrained(max_shard_size='{kb}KB'): {len(files)} shard(s), index={idx is not None}")
        if idx is not None and target_min <= len(files) <= target_max:
            return kb
    raise CheckFailed(f"could not get {target_min}-{target_max} shards (state dict {total} bytes)")


def add_fake_mtp(d, hidden):
    """Add mtp.fc.weight [hidden, 2*hidden] to the saved checkpoint (rewriting the file with save_file)."""
    files, idx = list_weight_files(d)
    target = files[-1]
    path = Path(d) / target
    tensors = {}
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        for k in f.keys():
            tensors[k] = f.get_tensor(k)
    if "format" not in meta:
        meta["format"] = "pt"
    g = torch.Generator().manual_seed(WEIGHT_SEED + 99)
    tensors["mtp.fc.weight"] = (torch.randn(hidden, 2 * hidden, generator=g) / math.sqrt(2 * hidden)).contiguous()
    save_file(tensors, str(path), metadata=meta)
    if idx is not None:
        j = json.loads(idx.read_text())
        j["weight_map"]["mtp.fc.weight"] = target
        if "metadata" in j and "total_size" in j["metadata"]:
            j["metadata"]["total_size"] = int(j["metadata"]["total_size"]) + tensors["mtp.fc.weight"].numel() * 4
        idx.write_text(json.dumps(j, indent=2, sort_keys=True) + "\n")
    print(f"  added mtp.fc.weight {list(tensors['mtp.fc.weight'].shape)} to {target} (metadata {meta})")


def check_layout(name, keys, cfg_text, tied):
    L = cfg_text.num_hidden_layers
    for k, (dt, shape, fn) in keys.items():
        check(dt in ("F32", "float32", "torch.float32"), f"{k} has dtype {dt}, wanted F32")
    if name in TEXT_ONLY:
        pre = "model."
        bad = [k for k in keys if not (k.startswith("model.") or k == "lm_head.weight")]
        check(not bad, f"unexpected keys (want model.* / lm_head.weight): {bad[:8]}")
    else:
        pre = "model.language_model."
        bad = [k for k in keys if not (k.startswith("model.language_model.") or k.startswith("model.visual.")
                                       or k == "lm_head.weight" or k.startswith("mtp."))]
        check(not bad, f"unexpected keys (want model.language_model.* / model.visual.* / lm_head / mtp.*): {bad[:8]}")
        check(any(k.startswith("model.visual.") for k in keys), "no model.visual.* keys")
        check("mtp.fc.weight" in keys, "mtp.fc.weight missing")
    check(f"{pre}embed_tokens.weight" in keys, f"{pre}embed_tokens.weight missing")
    check(f"{pre}norm.weight" in keys, f"{pre}norm.weight missing")
    if tied:
        check("lm_head.weight" not in keys, "tied model must not store lm_head.weight")
    else:
        check("lm_head.weight" in keys, "untied model must store lm_head.weight")
    lt = getattr(cfg_text, "layer_types", None) or [FULL] * L
    moe_layers = set()
    if getattr(cfg_text, "num_experts", 0):
        dense = set(getattr(cfg_text, "mlp_only_layers", None) or [])
        moe_layers = {i for i in range(L) if i not in dense and (i + 1) % getattr(cfg_text, "decoder_sparse_step", 1) == 0}
    for i in range(L):
        if name.startswith("qwen3_next") and lt[i] == LIN:
            need = ["linear_attn.in_proj_qkvz.weight", "linear_attn.in_proj_ba.weight", "linear_attn.conv1d.weight",
                    "linear_attn.A_log", "linear_attn.dt_bias", "linear_attn.norm.weight", "linear_attn.out_proj.weight"]
        elif name.startswith("qwen3_5") and lt[i] == LIN:
            need = ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_b.weight",
                    "linear_attn.in_proj_a.weight", "linear_attn.conv1d.weight", "linear_attn.A_log",
                    "linear_attn.dt_bias", "linear_attn.norm.weight", "linear_attn.out_proj.weight"]
        else:
            need = ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                    "self_attn.o_proj.weight"]
            if name != "llama":
                need += ["self_attn.q_norm.weight", "self_attn.k_norm.weight"]
        need += ["input_layernorm.weight", "post_attention_layernorm.weight"]
        if i in moe_layers:  # the experts may be stored fused (3-D) or one by one
            need += ["mlp.gate.weight", "mlp.shared_expert_gate.weight", "mlp.shared_expert.gate_proj.weight"]
            fused = f"{pre}layers.{i}.mlp.experts.gate_up_proj" in keys
            check(fused or f"{pre}layers.{i}.mlp.experts.0.gate_proj.weight" in keys, f"layer {i}: no expert weights")
        else:
            need += ["mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight"]
        for n in need:
            check(f"{pre}layers.{i}.{n}" in keys, f"{pre}layers.{i}.{n} missing")
    nl = {int(k[len(pre) + 7:].split(".")[0]) for k in keys if k.startswith(pre + "layers.")}
    check(nl == set(range(L)), f"layer indices in file {sorted(nl)} != 0..{L - 1}")


# --------------------------------------------------------------------------------------------------
# golden run
# --------------------------------------------------------------------------------------------------

@torch.no_grad()
def run_one(model, ids):
    """Forward one sequence alone; returns logits [T,V], hidden_states list of [T,D], raw layer outputs."""
    back = text_backbone(model)
    layers = back.layers
    raw = [None] * len(layers)
    hooks = []

    def mk(i):
        def hook(mod, args, output):
            out = output[0] if isinstance(output, (tuple, list)) else output
            raw[i] = out.detach().clone()
        return hook

    for i, layer in enumerate(layers):
        hooks.append(layer.register_forward_hook(mk(i)))
    try:
        out = model(input_ids=ids[None, :], output_hidden_states=True, use_cache=False, return_dict=True)
    finally:
        for h in hooks:
            h.remove()
    check(all(r is not None for r in raw), "a decoder-layer hook did not fire")
    logits = out.logits[0].float().contiguous()
    hs = [h[0].float().contiguous() for h in out.hidden_states]
    raw = [r[0].float().contiguous() for r in raw]
    return logits, hs, raw


@torch.no_grad()
def verify_outputs(model, ids, logits, hs, raw):
    back = text_backbone(model)
    L = len(back.layers)
    check(len(hs) == L + 1, f"len(hidden_states) = {len(hs)}, expected L+1 = {L + 1}")
    emb = back.embed_tokens(ids[None, :])[0].float()
    check(torch.equal(hs[0], emb), "hidden_states[0] != embed_tokens(ids)")
    for j in range(1, L):
        check(torch.equal(hs[j], raw[j - 1]), f"hidden_states[{j}] != raw output of layer {j - 1}")
    normed = back.norm(raw[L - 1][None])[0].float()
    last_is_norm = torch.equal(hs[L], normed) or torch.allclose(hs[L], normed, rtol=0, atol=1e-6)
    last_is_raw = torch.equal(hs[L], raw[L - 1])
    check(last_is_norm or last_is_raw, "hidden_states[L] is neither norm(raw last layer) nor the raw last layer")
    relogits = model.lm_head(hs[L][None] if last_is_norm else normed[None])[0].float()
    d = (relogits - logits).abs().max().item()
    check(d <= 1e-5, f"logits != lm_head(final hidden) (max diff {d:.3e})")
    return "final_norm" if last_is_norm else "raw_last_layer"


def gated_delta_rule_fp64(query, key, value, g, beta, chunk_size=64, initial_state=None,
                          output_final_state=False, use_qk_l2norm_in_kernel=False, **kwargs):
    """The gated delta rule, token by token, in float64, with the contract of transformers'
    torch_chunk_gated_delta_rule (modeling_qwen3_5.py). That fallback casts to float32 internally
    whatever the model dtype, and its chunked fp32 form is off by ~1e-5 relative at T = 100 with
    these gates, the size of the tolerance under test; the golden uses the exact rule instead."""
    q, k, v, b, gg = (x.transpose(1, 2).to(torch.float64) for x in (query, key, value, beta, g))
    hv = v.shape[1]
    if k.shape[1] != hv:  # grouped value attention: key head j // (Hv / Hk) serves value head j
        q, k = (x.repeat_interleave(hv // x.shape[1], dim=1) for x in (q, k))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * q.shape[-1] ** -0.5
    bsz, heads, T, dk = k.shape
    S = (torch.zeros(bsz, heads, dk, v.shape[-1], dtype=torch.float64) if initial_state is None
         else initial_state.to(torch.float64))
    out = torch.zeros_like(v)
    for t in range(T):
        S = S * gg[:, :, t].exp()[..., None, None]
        delta = (v[:, :, t] - (S * k[:, :, t, :, None]).sum(-2)) * b[:, :, t, None]
        S = S + k[:, :, t, :, None] * delta[:, :, None, :]
        out[:, :, t] = (S * q[:, :, t, :, None]).sum(-2)
    return out.transpose(1, 2).contiguous().to(query.dtype), (S if output_final_state else None)


@torch.no_grad()
def run_exact(model, ids):
    """Forward in float64 (weights are exact fp32 values) with the exact gated delta rule; returns
    what run_one returns, cast to float32. transformers still computes RMSNorm, gated norm and the
    softmax in float32 inside the fp64 model; those round at ~1e-7, far below the 1e-5 tolerance."""
    import importlib
    mods = [importlib.import_module(f"transformers.models.{n}.modeling_{n}")
            for n in ("qwen3_5", "qwen3_5_moe", "qwen3_next")]
    saved = [(m, m.torch_chunk_gated_delta_rule) for m in mods if hasattr(m, "torch_chunk_gated_delta_rule")]
    for m, _ in saved:
        m.torch_chunk_gated_delta_rule = gated_delta_rule_fp64
    exact = copy.deepcopy(model).double()
    for mod in exact.modules():  # Qwen3-Next binds the rule to each layer when it is built
        if hasattr(mod, "chunk_gated_delta_rule"):
            mod.chunk_gated_delta_rule = gated_delta_rule_fp64
        cfg = getattr(mod, "config", None)  # experts: the per-expert loop (grouped_mm has no float64)
        if cfg is not None and hasattr(cfg, "_experts_implementation"):
            cfg._experts_implementation = "eager"
    try:
        return run_one(exact, ids)
    finally:
        for m, f in saved:
            m.torch_chunk_gated_delta_rule = f


def save_bf16_weight_golden(model, seqs, golden, d, meta):
    """golden_bf16_weights.safetensors: run_exact of a copy of `model` whose matrices (every parameter of
    2+ dimensions except conv1d, which the GPU keeps in float32) are rounded to bfloat16: what the GPU's
    bf16 weights compute exactly. Prints what the rounding alone moves the logits by."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for pname, p in m.named_parameters():
            if p.dim() >= 2 and "conv1d" not in pname:
                p.copy_(p.to(torch.bfloat16).to(torch.float32))
    out = {}
    for i, ids in enumerate(seqs):
        logits_b, hs_b, _ = run_exact(m, ids)
        ref = golden[f"seq{i}.logits"]
        print(f"  seq{i}: bf16 weights vs float32 weights (both exact): logits relative L2 "
              f"{((logits_b - ref).norm() / ref.norm()).item():.3e}")
        out[f"seq{i}.input_ids"] = ids.clone().contiguous()
        out[f"seq{i}.logits"] = logits_b.clone()
        for j, h in enumerate(hs_b):
            out[f"seq{i}.hidden_states.{j}"] = h.clone()
    save_file(out, str(d / "golden_bf16_weights.safetensors"),
              metadata={**meta, "weights": "matrices except conv1d rounded to bfloat16 (round to nearest even)"})


def make_ids(vocab, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (T,), generator=g, dtype=torch.int64) for T in SEQ_LENS]


# --------------------------------------------------------------------------------------------------
# per model
# --------------------------------------------------------------------------------------------------

def build_one(name, out_root):
    print(f"\n=== {name} ===")
    d = out_root / name
    if d.exists():
        shutil.rmtree(d)
    cls, cfg = MODELS[name]()
    torch.manual_seed(0)
    model = cls(cfg).to(torch.float32).eval()
    force_eager(model)
    ct = text_config_of(model)
    want_tied = name == "qwen3"  # only the Qwen3 fixture ties lm_head to the embeddings
    if want_tied and not is_tied(model):
        model.tie_weights()
    check(is_tied(model) == want_tied, f"lm_head tied={is_tied(model)}, wanted {want_tied}")

    gain = BF16_LINEAR_GAIN if name in BF16_WEIGHT_GOLDENS else 1.0
    counts = nasty_init(model, WEIGHT_SEED + sum(map(ord, name)), linear_gain=gain,
                        experts_as_linear=name in BF16_WEIGHT_GOLDENS)
    print(f"  init: {counts}")
    check(is_tied(model) == want_tied, "tying changed during init")
    check(all(p.dtype == torch.float32 for p in model.parameters()), "non-float32 parameter")

    # save
    if name == "qwen3":
        save_sharded(model, d)
    else:
        model.save_pretrained(str(d))
    if name in WRAPPERS:
        add_fake_mtp(d, ct.hidden_size)
    files, idx = list_weight_files(d)
    keys = read_all_keys(d)
    check_layout(name, keys, ct, want_tied)
    cfg_json = json.loads((d / "config.json").read_text())
    print(f"  config.json: model_type={cfg_json.get('model_type')} architectures={cfg_json.get('architectures')}")
    exp_type = {"llama": "llama", "qwen3": "qwen3", "qwen3_hd64": "qwen3", "qwen3_5_text": "qwen3_5_text",
                "qwen3_5": "qwen3_5", "qwen3_5_text_hd64": "qwen3_5_text", "qwen3_5_hd64": "qwen3_5",
                "qwen3_5_moe": "qwen3_5_moe", "qwen3_next": "qwen3_next", "qwen3_5_moe_hd64": "qwen3_5_moe",
                "qwen3_next_hd64": "qwen3_next"}[name]
    check(cfg_json.get("model_type") == exp_type, f"config model_type {cfg_json.get('model_type')} != {exp_type}")

    # reload exactly as a user would and compare every weight with the in-memory model
    loaded = cls.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager",
                                 output_loading_info=True)
    reloaded, info = loaded if isinstance(loaded, tuple) else (loaded, {})
    reloaded.eval()
    force_eager(reloaded)
    missing = list(info.get("missing_keys", []) or [])
    mism = list(info.get("mismatched_keys", []) or [])
    unexp = list(info.get("unexpected_keys", []) or [])
    print(f"  reload: missing={missing} mismatched={mism} unexpected={unexp}")
    check(not missing, f"missing keys on reload: {missing}")
    check(not mism, f"mismatched keys on reload: {mism}")
    check(all(str(k).startswith("mtp.") for k in unexp), f"unexpected keys on reload: {unexp}")
    check(is_tied(reloaded) == want_tied, "reloaded model tying differs")
    sd_a, sd_b = model.state_dict(), reloaded.state_dict()
    check(set(sd_a) == set(sd_b), f"state_dict keys differ after reload: {sorted(set(sd_a) ^ set(sd_b))[:8]}")
    for k in sd_a:
        check(torch.equal(sd_a[k], sd_b[k]), f"weight {k} differs after reload")

    # golden
    V = ct.vocab_size
    L = ct.num_hidden_layers
    seqs = make_ids(V, IDS_SEED + sum(map(ord, name)))
    golden = {}
    last_kind = None
    results = []
    for i, ids in enumerate(seqs):
        logits, hs, raw = run_one(reloaded, ids)
        kind = verify_outputs(reloaded, ids, logits, hs, raw)
        check(last_kind in (None, kind), "inconsistent last hidden state kind")
        last_kind = kind
        check(torch.isfinite(logits).all().item(), f"seq{i}: non-finite logits")
        # the in-memory model must give bit-identical results
        logits_m, hs_m, _ = run_one(model, ids)
        check(torch.equal(logits, logits_m), f"seq{i}: reloaded vs in-memory logits differ "
                                             f"(max {(logits - logits_m).abs().max().item():.3e})")
        # The golden itself: the same model in float64 (see run_exact); the fp32 run must agree with it
        # to within fp32 noise, which shows the exact path computes the same function.
        logits_x, hs_x, raw_x = run_exact(reloaded, ids)
        err32 = ((logits - logits_x).norm() / logits_x.norm()).item()
        print(f"  seq{i}: transformers fp32 vs fp64 golden: logits relative L2 error {err32:.3e}")
        check(err32 <= 1e-3, f"seq{i}: fp32 and fp64 runs disagree ({err32:.3e}): the exact path is wrong")
        golden[f"seq{i}.input_ids"] = ids.clone().contiguous()
        golden[f"seq{i}.logits"] = logits_x.clone()
        for j, h in enumerate(hs_x):
            golden[f"seq{i}.hidden_states.{j}"] = h.clone()
        golden[f"seq{i}.last_layer_output"] = raw_x[-1].clone()
        results.append((ids, logits))
        print(f"  seq{i}: T={ids.numel()} logits {tuple(logits.shape)} |logits|max={logits.abs().max().item():.3f} "
              f"std={logits.std().item() if logits.numel() > 1 else 0.0:.3f} "
              f"hidden std: " + " ".join(f"{h.std().item():.3f}" for h in hs) + f"  last={kind}")

    # causality / chunk-consistency: the first 37 tokens of the 100-token sequence, run alone, must match
    ids100 = seqs[2]
    pref = ids100[:37]
    lp, _, _ = run_one(reloaded, pref)
    dmax = (lp - results[2][1][:37]).abs().max().item()
    scale = results[2][1][:37].abs().max().item()
    print(f"  causality: prefix(37) of seq2 vs full run: max |diff| = {dmax:.3e} (scale {scale:.2f})")
    check(dmax <= 1e-4 * max(1.0, scale), f"causality check failed: {dmax:.3e}")
    check(last_kind == "final_norm", f"hidden_states[-1] is {last_kind}, expected final_norm (5.x capture_outputs)")

    meta = {
        "num_layers": str(L),
        "num_sequences": str(len(SEQ_LENS)),
        "seq_lens": ",".join(str(t) for t in SEQ_LENS),
        "last_hidden_state": last_kind,
        "vocab_size": str(V),
        "hidden_size": str(ct.hidden_size),
        "model_class": cls.__name__,
        "model_type": exp_type,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "weight_seed": str(WEIGHT_SEED + sum(map(ord, name))),
        "linear_gain": str(gain),
        "ids_seed": str(IDS_SEED + sum(map(ord, name))),
        "device": "cpu",
        "dtype": "float64 computation (float32 weights), saved as float32",
        "attn_implementation": "eager",
    }
    lt = getattr(ct, "layer_types", None)
    if lt is not None:
        meta["layer_types"] = ",".join(lt)
    save_file(golden, str(d / "golden.safetensors"), metadata=meta)
    print(f"  golden metadata: {meta}")
    if name in BF16_WEIGHT_GOLDENS:
        save_bf16_weight_golden(reloaded, seqs, golden, d, meta)
    print(f"  last hidden state == model.norm(raw last-layer output): {last_kind == 'final_norm'}")

    # summary
    size = dir_size(d)
    print(f"  files ({size} bytes total):")
    for p in sorted(d.iterdir()):
        print(f"    {p.name:40s} {p.stat().st_size:9d}")
    print(f"  weight files: {len(files)} (index: {idx is not None}); tensors: {len(keys)}")
    ks = sorted(keys)
    for k in ks[:6] + (["..."] if len(ks) > 12 else []) + ks[-6:]:
        if k == "...":
            print("    ...")
        else:
            dt, shape, fn = keys[k]
            print(f"    {k:60s} {dt} {list(shape)} [{fn}]")
    check(size <= MAX_DIR_BYTES, f"{name}: directory is {size} bytes (> {MAX_DIR_BYTES})")
    if size > 1_000_000:
        print(f"  NOTE: {name} directory is {size} bytes (> 1 MB)")
    return size


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_out = Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    ap.add_argument("--out", type=Path, default=default_out, help="fixtures root (default: %(default)s)")
    ap.add_argument("--models", default=",".join(MODELS), help="comma-separated subset of " + ",".join(MODELS))
    args = ap.parse_args()

    names = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        ap.error(f"unknown model(s): {unknown}")

    torch.set_default_dtype(torch.float32)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    torch.manual_seed(0)

    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}")
    if not transformers.__version__.startswith("5."):
        print(f"WARNING: transformers {transformers.__version__} is not 5.x; goldens are meant for 5.17")
    for pkg in ("fla", "causal_conv1d"):
        try:
            __import__(pkg)
            print(f"WARNING: {pkg} is importable; transformers may dispatch to it instead of the torch fallback "
                  f"(this script runs on the CPU, where those kernels do not work)")
        except Exception:
            pass

    args.out.mkdir(parents=True, exist_ok=True)
    failures = []
    sizes = {}
    for name in names:
        try:
            sizes[name] = build_one(name, args.out)
        except Exception as e:  # keep going so one run reports every problem
            traceback.print_exc()
            failures.append((name, f"{type(e).__name__}: {e}"))

    print("\n=== summary ===")
    for name in names:
        status = "FAILED" if any(n == name for n, _ in failures) else f"ok ({sizes.get(name, 0)} bytes)"
        print(f"  {name:14s} {status}  -> {args.out / name}")
    for name, msg in failures:
        print(f"  FAIL {name}: {msg}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
