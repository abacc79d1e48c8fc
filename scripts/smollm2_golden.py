#!/usr/bin/env python3
"""Greedy-generation golden for SmolLM2-135M-Instruct loaded from its Q4_1 GGUF by transformers.

Where it runs: the GPU machine (Python 3.12, torch 2.11, transformers 5.17, the `gguf` package installed
from a wheel, no network). Everything runs on the CPU in float32 with eager attention: transformers
dequantizes the Q4_1 weights to float32, so this is the float32 reference of exactly those weights.

Cases:
  chat:  [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}] rendered with
         the GGUF's chat template (apply_chat_template, add_generation_prompt=True, tokenize=True)
  plain: "The quick brown fox" tokenized with the tokenizer's defaults (add_special_tokens=True), no template
For each: the prompt ids, 16 greedy tokens (do_sample=False, max_new_tokens=16; generation may stop early at
EOS, whatever it gives is recorded), the same greedy continuation recomputed WITHOUT a KV cache (full
forward per step) as a cross-check, and the last prompt position's logits as the top-20 (id, logit) pairs
plus the L2 norm of the full logits vector.

Writes JSON (default tests/fixtures/smollm2/golden.json) with keys gguf_file, gguf_sha256, prompt_messages,
prompt_text, prompt_ids, generated_ids, generated_text, last_prompt_logits_top20, last_prompt_logits_l2,
plain{...}, transformers, torch, gguf, settings; and prints everything.

Usage: python3 scripts/smollm2_golden.py [--gguf .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] [--out PATH]
"""

import argparse
import hashlib
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

CHAT_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
PLAIN_PROMPT = "The quick brown fox"
MAX_NEW_TOKENS = 16
TOP_K = 20


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def pkg_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        try:
            return getattr(__import__(name), "__version__", "unknown")
        except Exception:
            return "not installed"


def to_id_list(x):
    """apply_chat_template / tokenizer results -> flat list of ints (handles dict, BatchEncoding, tensor, nested)."""
    if isinstance(x, Mapping) or hasattr(x, "keys"):
        x = x["input_ids"]
    if isinstance(x, torch.Tensor):
        x = x.tolist()
    if len(x) > 0 and isinstance(x[0], (list, tuple)):
        if len(x) != 1:
            raise ValueError(f"expected a single sequence, got {len(x)}")
        x = x[0]
    return [int(t) for t in x]


def gguf_chat_template(path):
    """Read tokenizer.chat_template from the GGUF directly (fallback if the tokenizer did not get one)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    field = r.fields.get("tokenizer.chat_template")
    if field is None:
        return None
    part = field.parts[field.data[0]]
    return bytes(part).decode("utf-8")


@torch.no_grad()
def last_logits(model, ids):
    out = model(input_ids=torch.tensor([ids], dtype=torch.long), use_cache=False)
    return out.logits[0, -1].float()


@torch.no_grad()
def greedy_nocache(model, ids, n, eos_ids):
    ids = list(ids)
    gen = []
    for _ in range(n):
        nxt = int(torch.argmax(last_logits(model, ids)).item())
        gen.append(nxt)
        ids.append(nxt)
        if nxt in eos_ids:
            break
    return gen


@torch.no_grad()
def run_case(model, tok, prompt_ids, eos_ids, pad_id):
    input_ids = torch.tensor([prompt_ids], dtype=torch.long)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        do_sample=False,
        max_new_tokens=MAX_NEW_TOKENS,
        pad_token_id=pad_id,
    )
    gen = [int(t) for t in out[0, len(prompt_ids):].tolist()]
    gen_nc = greedy_nocache(model, prompt_ids, len(gen) if gen else MAX_NEW_TOKENS, eos_ids)
    # 16 argmax steps that do not stop at end-of-turn: what the C++ greedy test compares against.
    greedy16 = greedy_nocache(model, prompt_ids, 16, set())
    check_prefix = greedy16[:len(gen)] == gen
    logits = last_logits(model, prompt_ids)
    vals, idx = torch.topk(logits, TOP_K)
    return {
        "prompt_ids": list(prompt_ids),
        "generated_ids": gen,
        "generated_text": tok.decode(gen, skip_special_tokens=False),
        "generated_text_skip_special": tok.decode(gen, skip_special_tokens=True),
        "generated_ids_nocache": gen_nc,
        "nocache_matches_generate": gen_nc == gen,
        "greedy16_ids": greedy16,
        "greedy16_text": tok.decode(greedy16, skip_special_tokens=False),
        "greedy16_prefix_matches_generate": check_prefix,
        "last_prompt_logits_top20": [[int(i), float(v)] for i, v in zip(idx.tolist(), vals.tolist())],
        "last_prompt_logits_l2": float(torch.linalg.vector_norm(logits.double()).item()),
        "last_prompt_argmax": int(torch.argmax(logits).item()),
        "vocab_size": int(logits.numel()),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default_gguf = Path(__file__).resolve().parent.parent / ".cache" / "smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    ap.add_argument("--gguf", type=Path, default=default_gguf,
                    help="SmolLM2-135M-Instruct Q4_1 .gguf (default: where scripts/fetch_smollm2.sh puts it: %(default)s)")
    default_out = Path(__file__).resolve().parent.parent / "tests" / "fixtures" / "smollm2" / "golden.json"
    ap.add_argument("--out", type=Path, default=default_out, help="output JSON (default: %(default)s)")
    args = ap.parse_args()

    gguf_path = args.gguf.resolve()
    if not gguf_path.is_file():
        ap.error(f"no such file: {gguf_path}")

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")

    print(f"python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  "
          f"gguf {pkg_version('gguf')}")
    print(f"gguf file: {gguf_path}")
    digest = sha256_file(gguf_path)
    print(f"sha256: {digest}")

    d, name = str(gguf_path.parent), gguf_path.name
    tok = AutoTokenizer.from_pretrained(d, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32, attn_implementation="eager")
    model = model.to("cpu", torch.float32).eval()
    dtypes = {p.dtype for p in model.parameters()}
    if dtypes != {torch.float32}:
        print(f"ERROR: parameter dtypes {dtypes}, expected float32 only")
        sys.exit(1)
    print(f"model: {type(model).__name__} config: hidden={model.config.hidden_size} "
          f"layers={model.config.num_hidden_layers} heads={model.config.num_attention_heads}/"
          f"{model.config.num_key_value_heads} vocab={model.config.vocab_size} "
          f"tie={getattr(model.config, 'tie_word_embeddings', None)} "
          f"attn={getattr(model.config, '_attn_implementation', None)}")

    template_source = "tokenizer"
    if not getattr(tok, "chat_template", None):
        tmpl = gguf_chat_template(gguf_path)
        if not tmpl:
            print("ERROR: no chat template in the tokenizer or the GGUF")
            sys.exit(1)
        tok.chat_template = tmpl
        template_source = "gguf metadata (tokenizer had none)"
    print(f"chat template from: {template_source}")

    # generate() stops on the generation config's EOS ids (from the GGUF), not the tokenizer's: mirror that in the
    # no-cache loop. (transformers' GGUF llama tokenizer converter can mislabel bos/eos strings; recorded as-is.)
    eos_src = getattr(model.generation_config, "eos_token_id", None)
    if eos_src is None:
        eos_src = getattr(model.config, "eos_token_id", None)
    eos_ids = set()
    if isinstance(eos_src, int):
        eos_ids.add(eos_src)
    elif isinstance(eos_src, (list, tuple)):
        eos_ids.update(int(t) for t in eos_src)
    pad_id = getattr(model.generation_config, "pad_token_id", None)
    if pad_id is None:
        pad_id = tok.pad_token_id if tok.pad_token_id is not None else (min(eos_ids) if eos_ids else 0)
    print(f"generation eos ids: {sorted(eos_ids)}  pad id: {pad_id}  "
          f"tokenizer bos/eos: {tok.bos_token!r}={tok.bos_token_id} / {tok.eos_token!r}={tok.eos_token_id}")

    # chat case
    prompt_text = tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = to_id_list(tok.apply_chat_template(CHAT_MESSAGES, add_generation_prompt=True, tokenize=True))
    reenc = to_id_list(tok(prompt_text, add_special_tokens=False))
    chat = run_case(model, tok, prompt_ids, eos_ids, pad_id)

    # plain case
    plain_ids = to_id_list(tok(PLAIN_PROMPT))
    plain = run_case(model, tok, plain_ids, eos_ids, pad_id)
    plain = {"prompt_text": PLAIN_PROMPT, "add_special_tokens": True, **plain}

    result = {
        "gguf_file": name,
        "gguf_sha256": digest,
        "prompt_messages": CHAT_MESSAGES,
        "prompt_text": prompt_text,
        "prompt_ids": chat["prompt_ids"],
        "prompt_ids_equal_tokenized_text": reenc == prompt_ids,
        "generated_ids": chat["generated_ids"],
        "generated_text": chat["generated_text"],
        "generated_text_skip_special": chat["generated_text_skip_special"],
        "generated_ids_nocache": chat["generated_ids_nocache"],
        "nocache_matches_generate": chat["nocache_matches_generate"],
        "greedy16_ids": chat["greedy16_ids"],
        "greedy16_text": chat["greedy16_text"],
        "greedy16_prefix_matches_generate": chat["greedy16_prefix_matches_generate"],
        "last_prompt_logits_top20": chat["last_prompt_logits_top20"],
        "last_prompt_logits_l2": chat["last_prompt_logits_l2"],
        "last_prompt_argmax": chat["last_prompt_argmax"],
        "vocab_size": chat["vocab_size"],
        "plain": plain,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "gguf": pkg_version("gguf"),
        "settings": {
            "device": "cpu",
            "dtype": "float32",
            "attn_implementation": "eager",
            "do_sample": False,
            "max_new_tokens": MAX_NEW_TOKENS,
            "chat_template_source": template_source,
            "eos_token_ids": sorted(eos_ids),
            "pad_token_id": pad_id,
            "tokenizer_bos": [tok.bos_token, tok.bos_token_id],
            "tokenizer_eos": [tok.eos_token, tok.eos_token_id],
        },
    }

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")

    print(json.dumps(result, indent=1, ensure_ascii=False))
    print(f"\nchat prompt text:\n{prompt_text}")
    print(f"chat  generated: {chat['generated_text']!r}")
    print(f"plain generated: {plain['generated_text']!r}")
    ok = True
    for label, case in (("chat", chat), ("plain", plain)):
        if not case["nocache_matches_generate"]:
            print(f"WARNING: {label}: generate() and the no-cache greedy loop disagree")
        if case["generated_ids"] and case["generated_ids"][0] != case["last_prompt_argmax"]:
            print(f"ERROR: {label}: first generated id != argmax of the last prompt logits")
            ok = False
    if reenc != prompt_ids:
        print(f"WARNING: apply_chat_template ids differ from tokenizing prompt_text: {reenc}")
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
