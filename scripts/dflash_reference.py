#!/usr/bin/env python3
"""Plain PyTorch reference of the DFlash drafter training step (the golden for the C++ trainer).

Follows docs/dflash.md (shared project doc) to the letter:
  * Qwen3-style draft layers (pre-RMSNorm w * x_hat in fp32 math, GQA with per-head q_norm/k_norm,
    RoPE over the full head_dim with rotate_half pairing, SwiGLU MLP, no biases, final norm);
  * ctx = hidden_norm(fc(concat taps)) computed once; KV injection in EVERY layer: K/V = the layer's
    k_proj/v_proj over [ctx ; block tokens] (k_norm on both), queries only from block tokens;
  * positions: context token j -> j, block slot k of anchor a -> a + k;
  * block input [anchor token, MASK x (B-1)] embedded with the target's frozen embed_tokens,
    logits from the target's frozen lm_head (inputs, not parameters);
  * mask built element by element (see build_mask), padding blocks see nothing (output 0);
  * loss: slot k (1..B-1) -> token anchor+k, w = exp(-(k-1)/gamma) * loss_mask * in-bounds,
    loss = sum(w * CE) / sum(w); unweighted per-slot top-1 accuracy over positions with w > 0;
  * AdamW (torch semantics), global-norm clipping (torch clip_grad_norm_ semantics).

Where it runs: anywhere with CPU torch + numpy + safetensors (no GPU needed; everything is tiny and
runs in float64 on the CPU). In this project it was run on the CPU of the dev machine with a
pip-installed torch (python3 -m pip install --target /tmp/torchenv torch numpy safetensors; then
PYTHONPATH=/tmp/torchenv), or equally on the GPU machine (torch 2.11) -- the device is not used.

Usage:
  python3 scripts/dflash_reference.py --check
  python3 scripts/dflash_reference.py --make-golden tests/fixtures/drafter
  python3 scripts/dflash_reference.py --load-logits CKPT_DIR --inputs INPUTS.safetensors
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

# ----------------------------------------------------------------------------------------------
# Conventions (recorded into the golden as well)
# ----------------------------------------------------------------------------------------------
ADAM_BETAS = (0.9, 0.999)  # dflash.md does not state betas; torch.optim.AdamW defaults
ADAM_EPS = 1e-8
WEIGHT_DECAY = 0.0  # dflash.md: weight decay 0
LR = 6e-4  # dflash.md recipe peak lr; constant for the golden (no schedule)
MAX_GRAD_NORM = 1.0  # dflash.md: grad clip 1.0
CLIP_EPS = 1e-6  # torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), clamped to 1
GAMMA_BY_BLOCK = {16: 7.0, 10: 5.0, 8: 4.0}  # dflash.md


def default_gamma(block_size):
    if block_size in GAMMA_BY_BLOCK:
        return GAMMA_BY_BLOCK[block_size]
    raise ValueError(f"dflash.md gives no gamma for block_size={block_size}; pass one explicitly")


def default_target_layer_ids(num_target_layers, n):
    """dflash.md: n == 1 -> [L // 2]; else round(1 + i * (L - 4) / (n - 1))."""
    if n == 1:
        return [num_target_layers // 2]
    return [int(round(1 + i * (num_target_layers - 4) / (n - 1))) for i in range(n)]


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Plain RMSNorm: w * x_hat, statistics in fp32 (or wider if the input is float64)."""

    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        in_dtype = x.dtype
        xf = x.to(torch.float64 if in_dtype == torch.float64 else torch.float32)
        var = xf.pow(2).mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(var + self.eps)
        return self.weight * xf.to(in_dtype)


def rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def rope_cos_sin(positions, head_dim, theta, dtype):
    """Qwen3/HF 'default' RoPE over the full head_dim (rotate_half pairing: i with i + head_dim/2)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    freqs = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x, cos, sin):
    # x: [H, T, hd]; cos/sin: [T, hd]
    return x * cos[None] + rotate_half(x) * sin[None]


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, hd = cfg["hidden_size"], cfg["head_dim"]
        self.nh, self.nkv, self.hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], hd
        self.q_proj = nn.Linear(d, self.nh * hd, bias=False)
        self.k_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.v_proj = nn.Linear(d, self.nkv * hd, bias=False)
        self.o_proj = nn.Linear(self.nh * hd, d, bias=False)
        self.q_norm = RMSNorm(hd, cfg["rms_norm_eps"])
        self.k_norm = RMSNorm(hd, cfg["rms_norm_eps"])

    def forward(self, x, ctx, cos_q, sin_q, cos_kv, sin_kv, mask):
        # x: [Q, d] block tokens (normed), ctx: [S, d]; mask: [Q, S + Q] bool (True = may attend)
        Q, S = x.shape[0], ctx.shape[0]
        q = self.q_norm(self.q_proj(x).view(Q, self.nh, self.hd)).transpose(0, 1)  # [H, Q, hd]
        kv_in = torch.cat([ctx, x], dim=0)  # [S+Q, d]
        k = self.k_norm(self.k_proj(kv_in).view(S + Q, self.nkv, self.hd)).transpose(0, 1)
        v = self.v_proj(kv_in).view(S + Q, self.nkv, self.hd).transpose(0, 1)
        q = apply_rope(q, cos_q, sin_q)
        k = apply_rope(k, cos_kv, sin_kv)
        rep = self.nh // self.nkv  # GQA: query head h uses kv head h // rep
        k = k.repeat_interleave(rep, dim=0)
        v = v.repeat_interleave(rep, dim=0)
        scores = (q @ k.transpose(-1, -2)) * (self.hd ** -0.5)  # [H, Q, S+Q]
        row_valid = mask.any(dim=-1)  # [Q]
        # Fully masked rows (padding blocks): softmax over a dummy full row, then output := 0.
        safe = mask | ~row_valid[:, None]
        scores = scores.masked_fill(~safe[None], float("-inf"))
        p = torch.softmax(scores, dim=-1)
        out = (p @ v) * row_valid[None, :, None].to(v.dtype)  # [H, Q, hd]
        out = out.transpose(0, 1).reshape(Q, self.nh * self.hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        d, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.gate_proj = nn.Linear(d, i, bias=False)
        self.up_proj = nn.Linear(d, i, bias=False)
        self.down_proj = nn.Linear(i, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg["hidden_size"], cfg["rms_norm_eps"])
        self.mlp = MLP(cfg)

    def forward(self, h, ctx, rope, mask):
        h = h + self.self_attn(self.input_layernorm(h), ctx, *rope, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraft(nn.Module):
    """DFlash drafter; state_dict names == published safetensors names (no 'model.' prefix)."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        d = cfg["hidden_size"]
        self.target_layer_ids = list(cfg["dflash_config"]["target_layer_ids"])
        self.K = len(self.target_layer_ids)
        self.block_size = int(cfg["block_size"])
        self.mask_token_id = int(cfg["dflash_config"]["mask_token_id"])
        self.layer_types = list(cfg.get("layer_types") or ["full_attention"] * cfg["num_hidden_layers"])
        assert len(self.layer_types) == cfg["num_hidden_layers"]
        for t in self.layer_types:
            assert t in ("full_attention", "sliding_attention"), t
        self.sliding_window = cfg.get("sliding_window")
        if "sliding_attention" in self.layer_types:
            assert self.sliding_window is not None and self.sliding_window > 0
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg["num_hidden_layers"])])
        self.norm = RMSNorm(d, cfg["rms_norm_eps"])
        self.fc = nn.Linear(self.K * d, d, bias=False)
        self.hidden_norm = RMSNorm(d, cfg["rms_norm_eps"])

    def layer_window(self, i):
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    def forward(self, taps, ids, anchors, embed, lm_head, masks=None):
        """taps [S, K*d]; ids [S]; anchors [N] (long, -1 = padding block); embed/lm_head [V, d].

        Returns logits [N, B, V] (padding blocks included; their loss weight is 0)."""
        S = taps.shape[0]
        B = self.block_size
        N = anchors.shape[0]
        dtype = self.fc.weight.dtype
        ctx = self.hidden_norm(self.fc(taps.to(dtype)))  # [S, d], once
        block_ids, block_pos = block_inputs(ids, anchors, B, self.mask_token_id)
        h = embed.to(dtype)[block_ids.reshape(-1)]  # [N*B, d]
        pos_q = block_pos.reshape(-1)
        pos_kv = torch.cat([torch.arange(S), pos_q])
        hd, theta = self.cfg["head_dim"], float(self.cfg["rope_theta"])
        cos_q, sin_q = rope_cos_sin(pos_q, hd, theta, dtype)
        cos_kv, sin_kv = rope_cos_sin(pos_kv, hd, theta, dtype)
        if masks is None:
            masks = [build_mask(anchors, S, B, self.layer_window(i)) for i in range(len(self.layers))]
        for i, layer in enumerate(self.layers):
            h = layer(h, ctx, (cos_q, sin_q, cos_kv, sin_kv), masks[i])
        h = self.norm(h)
        logits = h @ lm_head.to(dtype).t()
        return logits.view(N, B, -1)


def block_inputs(ids, anchors, B, mask_token_id):
    """Block b: tokens [ids[anchor_b], MASK x (B-1)], positions anchor_b + k.

    Padding blocks (anchor -1): all MASK, positions 0..B-1 (irrelevant: they see nothing, nobody sees
    them, and their loss weight is 0)."""
    N = anchors.shape[0]
    tok = torch.full((N, B), mask_token_id, dtype=torch.long)
    pos = torch.zeros((N, B), dtype=torch.long)
    for b in range(N):
        a = int(anchors[b])
        base = a if a >= 0 else 0
        if a >= 0:
            tok[b, 0] = int(ids[a])
        for k in range(B):
            pos[b, k] = base + k
    return tok, pos


def build_mask(anchors, S, B, window=None):
    """Element-by-element mask [N*B, S + N*B] (True = query may attend to key), per dflash.md:

    * query (block b, slot k), anchor a = anchors[b] >= 0:
      - context key at position p (0 <= p < S): visible iff p < a (strictly); for a sliding layer
        additionally p >= a + k - (window - 1)
      - block key (block c, slot j): visible iff c == b (all B slots, non-causal); for a sliding
        layer only j <= k
    * padding block (a < 0): sees nothing."""
    N = anchors.shape[0]
    m = torch.zeros((N * B, S + N * B), dtype=torch.bool)
    for b in range(N):
        a = int(anchors[b])
        if a < 0:
            continue
        for k in range(B):
            qi = b * B + k
            for p in range(S):
                ok = p < a
                if window is not None:
                    ok = ok and p >= a + k - (window - 1)
                m[qi, p] = ok
            for c in range(N):
                for j in range(B):
                    ok = c == b
                    if window is not None:
                        ok = ok and j <= k
                    m[qi, S + c * B + j] = ok
    return m


def loss_weights(ids, loss_mask, anchors, B, gamma):
    """labels [N, B] (slot k -> ids[anchor + k], -1 where undefined) and weights [N, B] float64.

    w[b, k] = exp(-(k-1)/gamma) * loss_mask[a+k] * (a+k < S), k >= 1; w[b, 0] = 0; padding: 0."""
    S = ids.shape[0]
    N = anchors.shape[0]
    labels = torch.full((N, B), -1, dtype=torch.long)
    w = torch.zeros((N, B), dtype=torch.float64)
    for b in range(N):
        a = int(anchors[b])
        if a < 0:
            continue
        for k in range(1, B):
            t = a + k
            if t < S:
                labels[b, k] = int(ids[t])
                w[b, k] = math.exp(-(k - 1) / gamma) * float(loss_mask[t])
    return labels, w


def dflash_loss(logits, labels, w):
    """loss = sum(w * CE) / sum(w); per-slot top-1 accuracy over positions with w > 0."""
    N, B, V = logits.shape
    lp = torch.log_softmax(logits, dim=-1)
    safe_labels = labels.clamp(min=0)
    ce = -lp.gather(-1, safe_labels[..., None])[..., 0]  # [N, B]
    wt = w.to(logits.dtype)
    loss = (wt * ce).sum() / wt.sum()
    with torch.no_grad():
        pred = logits.argmax(-1)
        valid = w > 0
        correct = torch.zeros(B, dtype=torch.float64)
        count = torch.zeros(B, dtype=torch.float64)
        for k in range(B):
            vk = valid[:, k]
            count[k] = vk.sum()
            correct[k] = ((pred[:, k] == labels[:, k]) & vk).sum()
        acc = torch.where(count > 0, correct / count.clamp(min=1), torch.zeros_like(count))
    return loss, acc, correct, count


# ----------------------------------------------------------------------------------------------
# Optimizer (explicit, torch.optim.AdamW semantics) and clipping
# ----------------------------------------------------------------------------------------------
def clip_grads_(params, max_norm=MAX_GRAD_NORM):
    total = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
    coef = min(1.0, max_norm / (float(total) + CLIP_EPS))
    for p in params:
        p.grad.mul_(coef)
    return float(total), coef


class AdamW:
    def __init__(self, params, lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY):
        self.params = list(params)
        self.lr, self.b1, self.b2, self.eps, self.wd = lr, betas[0], betas[1], eps, weight_decay
        self.m = [torch.zeros_like(p) for p in self.params]
        self.v = [torch.zeros_like(p) for p in self.params]
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        bc1 = 1 - self.b1 ** self.t
        bc2 = 1 - self.b2 ** self.t
        for p, m, v in zip(self.params, self.m, self.v):
            g = p.grad
            p.mul_(1 - self.lr * self.wd)
            m.mul_(self.b1).add_(g, alpha=1 - self.b1)
            v.mul_(self.b2).addcmul_(g, g, value=1 - self.b2)
            denom = v.sqrt() / math.sqrt(bc2) + self.eps
            p.addcdiv_(m, denom, value=-self.lr / bc1)


# ----------------------------------------------------------------------------------------------
# Checkpoint I/O ("published loading code path": config.json + model.safetensors, strict names)
# ----------------------------------------------------------------------------------------------
def expected_shapes(cfg):
    d, hd = cfg["hidden_size"], cfg["head_dim"]
    nh, nkv, inter = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["intermediate_size"]
    K = len(cfg["dflash_config"]["target_layer_ids"])
    shp = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}."
        shp[p + "self_attn.q_proj.weight"] = (nh * hd, d)
        shp[p + "self_attn.k_proj.weight"] = (nkv * hd, d)
        shp[p + "self_attn.v_proj.weight"] = (nkv * hd, d)
        shp[p + "self_attn.o_proj.weight"] = (d, nh * hd)
        shp[p + "self_attn.q_norm.weight"] = (hd,)
        shp[p + "self_attn.k_norm.weight"] = (hd,)
        shp[p + "mlp.gate_proj.weight"] = (inter, d)
        shp[p + "mlp.up_proj.weight"] = (inter, d)
        shp[p + "mlp.down_proj.weight"] = (d, inter)
        shp[p + "input_layernorm.weight"] = (d,)
        shp[p + "post_attention_layernorm.weight"] = (d,)
    shp["fc.weight"] = (d, K * d)
    shp["hidden_norm.weight"] = (d,)
    shp["norm.weight"] = (d,)
    return shp


def validate_config(cfg):
    req = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "vocab_size",
           "block_size", "num_target_layers", "dflash_config"]
    missing = [k for k in req if k not in cfg]
    if missing:
        raise ValueError(f"config.json is missing {missing}")
    if "DFlashDraftModel" not in (cfg.get("architectures") or []):
        raise ValueError(f"architectures must contain DFlashDraftModel, got {cfg.get('architectures')}")
    dc = cfg["dflash_config"]
    for k in ("mask_token_id", "target_layer_ids"):
        if k not in dc:
            raise ValueError(f"dflash_config is missing {k}")
    if not 0 <= int(dc["mask_token_id"]) < int(cfg["vocab_size"]):
        raise ValueError("mask_token_id out of range")
    if any(not 0 <= t < cfg["num_target_layers"] for t in dc["target_layer_ids"]):
        raise ValueError("target_layer_ids out of range")
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
    lt = cfg.get("layer_types")
    if lt is not None and len(lt) != cfg["num_hidden_layers"]:
        raise ValueError("layer_types must have one entry per draft layer")


def load_checkpoint(ckpt_dir, dtype=torch.float32):
    """config.json + model.safetensors (bf16/f16/f32) -> DFlashDraft. Strict names and shapes.

    Like SGLang's load_weights, a leading 'model.' prefix is stripped; anything else unknown,
    missing or mis-shaped is an error (SGLang silently ignores unknown names; we do not)."""
    from safetensors.torch import load_file

    with open(os.path.join(ckpt_dir, "config.json")) as f:
        cfg = json.load(f)
    validate_config(cfg)
    tensors = load_file(os.path.join(ckpt_dir, "model.safetensors"))
    tensors = {(k[len("model."):] if k.startswith("model.") else k): v for k, v in tensors.items()}
    shp = expected_shapes(cfg)
    missing = sorted(set(shp) - set(tensors))
    unexpected = sorted(set(tensors) - set(shp))
    if missing or unexpected:
        raise ValueError(f"checkpoint names mismatch: missing={missing} unexpected={unexpected}")
    for k, s in shp.items():
        if tuple(tensors[k].shape) != s:
            raise ValueError(f"{k}: shape {tuple(tensors[k].shape)} != expected {s}")
        if tensors[k].dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"{k}: unsupported dtype {tensors[k].dtype}")
    model = DFlashDraft(cfg).to(dtype)
    sd = {k: v.to(dtype) for k, v in tensors.items()}
    model.load_state_dict(sd, strict=True)
    return model


def save_checkpoint(model, out_dir, dtype=torch.float32):
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(model.cfg, f, indent=2)
    sd = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------------------------
# Tiny config and golden data
# ----------------------------------------------------------------------------------------------
def tiny_config():
    L = 8
    n = 3
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 48,
        "intermediate_size": 80,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        "vocab_size": 97,
        "block_size": 4,
        "num_target_layers": L,
        "dflash_config": {"mask_token_id": 96, "target_layer_ids": default_target_layer_ids(L, n)},
        "layer_types": ["sliding_attention", "full_attention"],
        "sliding_window": 6,
        "use_sliding_window": True,
        "max_window_layers": 2,
        "tie_word_embeddings": False,
        "max_position_embeddings": 512,
        "torch_dtype": "float32",
    }


TINY_GAMMA = 2.0  # dflash.md has no gamma for B = 4; chosen (B=8 -> 4, so B=4 -> 2 by the same ratio)


def tiny_problem(seed=1234):
    """Random weights (rounded to fp32, held in float64) and inputs for the tiny config."""
    cfg = tiny_config()
    g = torch.Generator().manual_seed(seed)
    model = DFlashDraft(cfg).double()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # norm weights: 1 + 0.3 randn
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
            else:
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) / math.sqrt(p.shape[1]))
            p.copy_(p.float().double())  # exactly representable in fp32
    S, d, V, K = 23, cfg["hidden_size"], cfg["vocab_size"], len(cfg["dflash_config"]["target_layer_ids"])
    taps = torch.randn(S, K * d, generator=g, dtype=torch.float64).float().double()
    embed = torch.randn(V, d, generator=g, dtype=torch.float64).float().double()
    lm_head = (torch.randn(V, d, generator=g, dtype=torch.float64) / math.sqrt(d)).float().double()
    ids = torch.randint(0, V - 1, (S,), generator=g)  # never the mask token
    loss_mask = (torch.rand(S, generator=g) < 0.8).long()
    loss_mask[:2] = 0  # "prompt"
    anchors = torch.tensor([2, 5, 9, 15, 21, -1], dtype=torch.long)  # -1 = padding block
    for a in anchors.tolist():
        if a >= 0:
            loss_mask[a] = 1
            if a + 1 < S:
                loss_mask[a + 1] = 1
    loss_mask[11] = 0  # inside block of anchor 9 (slot 2)
    loss_mask[18] = 0  # inside block of anchor 15 (slot 3)
    inp = dict(taps=taps, ids=ids, loss_mask=loss_mask, anchors=anchors, embed=embed, lm_head=lm_head)
    # Make top-1 accuracy non-trivial: a few non-anchor labels := the initial model's argmax.
    # Labels at non-anchor positions do not change any block input, so the logits stay the same.
    with torch.no_grad():
        lg = model(taps, ids, anchors, embed, lm_head)
    anchor_set = set(anchors.tolist())
    for b, k in ((0, 1), (0, 2), (1, 3), (3, 1)):
        t = int(anchors[b]) + k
        assert t not in anchor_set
        ids[t] = int(lg[b, k].argmax())
    return cfg, model, inp


def compute_loss(model, inp, gamma):
    B = model.block_size
    logits = model(inp["taps"], inp["ids"], inp["anchors"], inp["embed"], inp["lm_head"])
    labels, w = loss_weights(inp["ids"], inp["loss_mask"], inp["anchors"], B, gamma)
    loss, acc, correct, count = dflash_loss(logits, labels, w)
    return loss, logits, acc, correct, count, labels, w


# ----------------------------------------------------------------------------------------------
# --check
# ----------------------------------------------------------------------------------------------
def run_check():
    torch.manual_seed(0)
    cfg, model, inp = tiny_problem()
    gamma = TINY_GAMMA
    B, S = cfg["block_size"], inp["taps"].shape[0]
    ok = True

    def report(name, good, detail=""):
        nonlocal ok
        ok = ok and good
        print(f"[{'PASS' if good else 'FAIL'}] {name} {detail}")

    # 1. autograd vs central finite differences, float64
    params = dict(model.named_parameters())
    model.zero_grad()
    loss, *_ = compute_loss(model, inp, gamma)
    loss.backward()
    grads = {k: p.grad.clone() for k, p in params.items()}

    def loss_at(delta, eps):
        with torch.no_grad():
            for k, p in params.items():
                p.add_(eps * delta[k])
            l = float(compute_loss(model, inp, gamma)[0])
            for k, p in params.items():
                p.sub_(eps * delta[k])
        return l

    g = torch.Generator().manual_seed(7)
    worst = 0.0
    dirs = []
    for _ in range(4):  # global random directions
        dirs.append(("global", {k: torch.randn(p.shape, generator=g, dtype=torch.float64) for k, p in params.items()}))
    for name in params:  # one direction per parameter tensor
        dirs.append((name, {k: (torch.randn(p.shape, generator=g, dtype=torch.float64) if k == name
                                else torch.zeros_like(p)) for k, p in params.items()}))
    for name, delta in dirs:
        nrm = math.sqrt(sum(float((t ** 2).sum()) for t in delta.values()))
        delta = {k: t / nrm for k, t in delta.items()}  # unit direction
        h = 1e-3  # 4th-order central difference (Richardson): error O(h^4)
        fd = (8 * (loss_at(delta, h) - loss_at(delta, -h))
              - (loss_at(delta, 2 * h) - loss_at(delta, -2 * h))) / (12 * h)
        an = float(sum((grads[k] * delta[k]).sum() for k in params))
        rel = abs(fd - an) / max(abs(an), 1e-12)
        worst = max(worst, rel)
        if name == "global" or rel > 1e-6:
            print(f"    FD {name:45s} autograd={an:+.10e} fd={fd:+.10e} rel={rel:.2e}")
    report("finite differences (4 global + 1 per tensor unit directions)", worst < 1e-7, f"worst rel={worst:.2e}")

    # 2. mask: vectorized formula vs element-by-element build
    anchors = inp["anchors"]
    for window in (None, cfg["sliding_window"]):
        m = build_mask(anchors, S, B, window)
        N = anchors.shape[0]
        qb = torch.arange(N * B) // B
        qk = torch.arange(N * B) % B
        a = anchors[qb]
        p = torch.arange(S)
        ctx = (p[None, :] < a[:, None]) & (a[:, None] >= 0)
        if window is not None:
            ctx &= p[None, :] >= (a + qk - (window - 1))[:, None]
        kb = torch.arange(N * B) // B
        kk = torch.arange(N * B) % B
        blk = (qb[:, None] == kb[None, :]) & (a[:, None] >= 0)
        if window is not None:
            blk &= kk[None, :] <= qk[:, None]
        ref = torch.cat([ctx, blk], dim=1)
        report(f"mask formula (window={window})", torch.equal(m, ref))
        report(f"padding rows empty (window={window})", not m[(N - 1) * B:].any())

    # 3. strictness: block b's logits do not depend on taps at positions >= anchor_b,
    #    nor on other blocks (drop other anchors -> same logits)
    with torch.no_grad():
        base = model(inp["taps"], inp["ids"], anchors, inp["embed"], inp["lm_head"])
        for b, a in enumerate(anchors.tolist()):
            if a < 0:
                continue
            taps2 = inp["taps"].clone()
            taps2[a:] += torch.randn_like(taps2[a:])
            out2 = model(taps2, inp["ids"], anchors, inp["embed"], inp["lm_head"])
            report(f"block {b} (anchor {a}) ignores taps >= anchor",
                   torch.allclose(out2[b], base[b], rtol=0, atol=1e-12))
            solo = model(inp["taps"], inp["ids"], torch.tensor([a]), inp["embed"], inp["lm_head"])
            report(f"block {b} independent of other blocks", torch.allclose(solo[0], base[b], rtol=0, atol=1e-12))
            if a > 0:
                taps3 = inp["taps"].clone()
                taps3[a - 1] += 1.0
                out3 = model(taps3, inp["ids"], anchors, inp["embed"], inp["lm_head"])
                report(f"block {b} does depend on taps[anchor-1]", not torch.allclose(out3[b], base[b]))
        report("no NaN anywhere", bool(torch.isfinite(base).all()))

    # 4. loss weights: out-of-bounds slots weigh 0, loss_mask zeros weigh 0, labels are ids[a+k]
    labels, w = loss_weights(inp["ids"], inp["loss_mask"], anchors, B, gamma)
    report("slot 0 and padding blocks weigh 0", float(w[:, 0].abs().sum()) == 0 and float(w[-1].abs().sum()) == 0)
    report("anchor 21: slots 2,3 out of bounds -> 0", float(w[4, 2]) == 0 and float(w[4, 3]) == 0 and float(w[4, 1]) > 0)
    report("loss_mask[11]=0 -> block(anchor 9) slot 2 weighs 0", float(w[2, 2]) == 0)
    report("loss_mask[18]=0 -> block(anchor 15) slot 3 weighs 0", float(w[3, 3]) == 0)
    report("labels are ids[anchor+k]", int(labels[1, 3]) == int(inp["ids"][8]))
    report("weight decay exp(-(k-1)/gamma)", abs(float(w[0, 2]) - math.exp(-1 / gamma)) < 1e-15)
    with torch.no_grad():
        l0 = float(compute_loss(model, inp, gamma)[0])
        ids2 = inp["ids"].clone()
        ids2[11] = (ids2[11] + 1) % (cfg["vocab_size"] - 1)  # label under loss_mask 0 (not an anchor)
        l1 = float(compute_loss(model, dict(inp, ids=ids2), gamma)[0])
        report("changing a label under loss_mask=0 leaves the loss unchanged", l0 == l1, f"{l0} {l1}")
        bb, kk = [(b, k) for b in range(w.shape[0]) for k in range(1, B) if float(w[b, k]) > 0][0]
        t = int(anchors[bb]) + kk
        ids3 = inp["ids"].clone()
        ids3[t] = (ids3[t] + 1) % (cfg["vocab_size"] - 1)
        l2 = float(compute_loss(model, dict(inp, ids=ids3), gamma)[0])
        report("changing a weighted label changes the loss", l0 != l2)

    # 5. explicit AdamW + clipping == torch.optim.AdamW + clip_grad_norm_
    _, m1, _ = tiny_problem()
    _, m2, _ = tiny_problem()
    opt1 = AdamW(m1.parameters())
    opt2 = torch.optim.AdamW(m2.parameters(), lr=LR, betas=ADAM_BETAS, eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)
    for step in range(3):
        for m in (m1, m2):
            m.zero_grad()
            compute_loss(m, inp, gamma)[0].backward()
        clip_grads_(list(m1.parameters()))
        torch.nn.utils.clip_grad_norm_(m2.parameters(), MAX_GRAD_NORM)
        opt1.step()
        opt2.step()
    diff = max(float((a - b).detach().abs().max()) for a, b in zip(m1.parameters(), m2.parameters()))
    report("explicit AdamW/clip == torch.optim.AdamW/clip_grad_norm_", diff < 1e-12, f"max abs diff {diff:.2e}")

    # 6. checkpoint round trip (fp32 and bf16) through the strict loader
    import tempfile
    with tempfile.TemporaryDirectory() as td:
        m32 = model.float()
        save_checkpoint(m32, td, torch.float32)
        lm = load_checkpoint(td, torch.float32)
        with torch.no_grad():
            a = m32(inp["taps"], inp["ids"], anchors, inp["embed"], inp["lm_head"])
            b = lm(inp["taps"], inp["ids"], anchors, inp["embed"], inp["lm_head"])
        report("fp32 checkpoint round trip gives identical logits", torch.equal(a, b))
        save_checkpoint(m32, td, torch.bfloat16)
        lb = load_checkpoint(td, torch.float32)
        ref = DFlashDraft(cfg).float()
        ref.load_state_dict({k: v.bfloat16().float() for k, v in m32.state_dict().items()})
        with torch.no_grad():
            c = lb(inp["taps"], inp["ids"], anchors, inp["embed"], inp["lm_head"])
            e = ref(inp["taps"], inp["ids"], anchors, inp["embed"], inp["lm_head"])
        report("bf16 checkpoint loads (== bf16-rounded weights)", torch.equal(c, e))
        from safetensors.torch import load_file, save_file
        sd = load_file(os.path.join(td, "model.safetensors"))
        sd["extra.weight"] = torch.zeros(1)
        save_file(sd, os.path.join(td, "model.safetensors"))
        try:
            load_checkpoint(td)
            report("loader rejects unexpected names", False)
        except ValueError:
            report("loader rejects unexpected names", True)
        model.double()
    print("ALL CHECKS PASSED" if ok else "SOME CHECKS FAILED")
    return 0 if ok else 1


# ----------------------------------------------------------------------------------------------
# --make-golden
# ----------------------------------------------------------------------------------------------
def make_golden(out_dir):
    from safetensors.torch import save_file

    cfg, model, inp = tiny_problem()
    gamma = TINY_GAMMA
    B, S = cfg["block_size"], inp["taps"].shape[0]
    os.makedirs(out_dir, exist_ok=True)
    ckpt = os.path.join(out_dir, "init")
    save_checkpoint(model, ckpt, torch.float32)
    # the golden starts from the checkpoint exactly as the published loader reads it
    model = load_checkpoint(ckpt, torch.float64)

    inputs = {
        "taps": inp["taps"].float(),
        "embed_tokens": inp["embed"].float(),
        "lm_head": inp["lm_head"].float(),
        "ids": inp["ids"].to(torch.int64),
        "loss_mask": inp["loss_mask"].to(torch.int64),
        "anchors": inp["anchors"].to(torch.int64),
        "mask_token_id": torch.tensor([cfg["dflash_config"]["mask_token_id"]], dtype=torch.int64),
    }
    save_file(inputs, os.path.join(out_dir, "inputs.safetensors"))

    masks = {}
    for i in range(cfg["num_hidden_layers"]):
        masks[f"mask.layer{i}"] = build_mask(inp["anchors"], S, B, model.layer_window(i))
    block_ids, block_pos = block_inputs(inp["ids"], inp["anchors"], B, cfg["dflash_config"]["mask_token_id"])
    labels, w = loss_weights(inp["ids"], inp["loss_mask"], inp["anchors"], B, gamma)

    params = list(model.parameters())
    names = [n for n, _ in model.named_parameters()]
    opt = AdamW(params)
    out = {}
    step_losses, norms, coefs = [], [], []
    for step in range(4):  # 3 AdamW steps, then the loss at the final weights
        model.zero_grad()
        loss, logits, acc, correct, count, _, _ = compute_loss(model, inp, gamma)
        step_losses.append(float(loss.detach()))
        if step == 3:
            break
        loss.backward()
        if step == 0:
            out["loss"] = loss.detach().reshape(1)
            out["slot_accuracy"] = acc
            out["slot_correct"] = correct
            out["slot_count"] = count
            out["logits.block0"] = logits[0].detach().clone()
            out["logits.block2"] = logits[2].detach().clone()
            out["logits.all"] = logits.detach()
            for n, p in zip(names, params):
                out["grad." + n] = p.grad.detach().float()  # fp32: rounding 6e-8 << 1e-5
        total, coef = clip_grads_(params)
        norms.append(total)
        coefs.append(coef)
        opt.step()
    for n, p in zip(names, params):
        out["after3." + n] = p.detach().clone()  # float64: deltas from init stay exact
    out["step_losses"] = torch.tensor(step_losses, dtype=torch.float64)
    out["grad_norm_preclip"] = torch.tensor(norms, dtype=torch.float64)
    out["clip_coef"] = torch.tensor(coefs, dtype=torch.float64)
    out["labels"] = labels
    out["loss_weights"] = w
    out["block_ids"] = block_ids
    out["block_positions"] = block_pos
    out.update(masks)
    # logits.all is redundant with block0/block2 but tiny; keep all blocks (padding block too)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "golden.safetensors"))

    meta = {
        "generator": "scripts/dflash_reference.py --make-golden",
        "math_dtype": "float64 (weights and inputs are exactly fp32-representable)",
        "gamma": gamma,
        "optimizer": {"type": "AdamW (torch.optim.AdamW semantics)", "lr": LR, "betas": list(ADAM_BETAS),
                      "eps": ADAM_EPS, "weight_decay": WEIGHT_DECAY, "schedule": "constant"},
        "grad_clip": {"max_norm": MAX_GRAD_NORM, "norm": "global L2 over all params",
                      "coef": "min(1, max_norm / (norm + 1e-6))"},
        "steps": 3, "same_batch_each_step": True,
        "step_losses": step_losses, "grad_norm_preclip": norms, "clip_coef": coefs,
        "padding_anchor": -1,
        "seq_len": S, "num_anchors": int(inp["anchors"].shape[0]),
        "anchors": inp["anchors"].tolist(),
        "loss": step_losses[0],
        "slot_accuracy": out["slot_accuracy"].tolist(),
    }
    meta["fp32_torch_vs_golden"] = fp32_vs_golden(out_dir)
    with open(os.path.join(out_dir, "golden_meta.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(json.dumps(meta, indent=2))
    return 0


def fp32_vs_golden(out_dir):
    """Replay the golden in float32 PyTorch (what the C++ fp32 path should achieve at least)."""
    from safetensors.torch import load_file

    g = load_file(os.path.join(out_dir, "golden.safetensors"))
    x = load_file(os.path.join(out_dir, "inputs.safetensors"))
    m = load_checkpoint(os.path.join(out_dir, "init"), torch.float32)
    inp = dict(taps=x["taps"], ids=x["ids"], loss_mask=x["loss_mask"], anchors=x["anchors"],
               embed=x["embed_tokens"], lm_head=x["lm_head"])
    opt = AdamW(m.parameters())
    res = {}

    def rel(a, b):
        a, b = a.detach().double(), b.double()
        return float((a - b).norm() / b.norm()), float((a - b).abs().max() / b.abs().max())

    for step in range(3):
        m.zero_grad()
        loss, logits, *_ = compute_loss(m, inp, TINY_GAMMA)
        loss.backward()
        if step == 0:
            res["loss_rel"] = abs(float(loss.detach()) - float(g["loss"])) / abs(float(g["loss"]))
            res["logits_rel_frob_maxabs"] = rel(logits, g["logits.all"])
            r = [rel(p.grad, g["grad." + n]) for n, p in m.named_parameters()]
            res["grad_worst_rel_frob"] = max(a for a, _ in r)
            res["grad_worst_rel_maxabs"] = max(b for _, b in r)
        clip_grads_(list(m.parameters()))
        opt.step()
    r = [rel(p, g["after3." + n]) for n, p in m.named_parameters()]
    res["after3_worst_rel_frob"] = max(a for a, _ in r)
    res["after3_worst_rel_maxabs"] = max(b for _, b in r)
    res["note"] = ("rel_frob = ||a-b||/||b|| per tensor; rel_maxabs = max|a-b| / max|b| per tensor; "
                   "worst over tensors")
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="finite differences, mask/loss edge cases, loader")
    ap.add_argument("--make-golden", metavar="OUT_DIR", help="write the tiny-config golden fixtures")
    ap.add_argument("--load-logits", metavar="CKPT_DIR",
                    help="load a published-format checkpoint and print logits for --inputs")
    ap.add_argument("--inputs", help="inputs.safetensors (taps, ids, anchors, embed_tokens, lm_head)")
    ap.add_argument("--logits-out", help="with --load-logits: save {'logits': [N, B, V]} here")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"],
                    help="compute dtype for --load-logits")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(8, os.cpu_count() or 1)))
    rc = 0
    if args.check:
        rc |= run_check()
    if args.make_golden:
        rc |= make_golden(args.make_golden)
    if args.load_logits:
        from safetensors.torch import load_file
        from safetensors.torch import save_file
        m = load_checkpoint(args.load_logits, getattr(torch, args.dtype))
        x = load_file(args.inputs)
        with torch.no_grad():
            lg = m(x["taps"], x["ids"], x["anchors"], x["embed_tokens"], x["lm_head"])
        if args.logits_out:
            save_file({"logits": lg.contiguous()}, args.logits_out)
        torch.set_printoptions(precision=6)
        print(lg)
    if not (args.check or args.make_golden or args.load_logits):
        ap.print_help()
    return rc


if __name__ == "__main__":
    sys.exit(main())
