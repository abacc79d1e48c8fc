#!/usr/bin/env python3
"""Tokenizer goldens: the ids, decodes and offsets of Hugging Face `tokenizers` / `transformers` for one list of
hard strings, for the two real tokenizers the C++ tokenizer must match exactly (tests/text/tokenizer_test.cpp).

  qwen3:   tokenizers.Tokenizer.from_file(<shared>/tokenizers/qwen3/tokenizer.json)
           -> tests/fixtures/tokenizer/qwen3.json. Needs only `tokenizers` (the dev machine's /tmp/hfenv works).
  smollm2: transformers.AutoTokenizer.from_pretrained(dir, gguf_file=...) on SmolLM2-135M-Instruct's GGUF, i.e.
           transformers' GGUFLlamaConverter ("llama-3" byte-level path since tokenizer.ggml.model is gpt2)
           -> tests/fixtures/tokenizer/smollm2.json, and the converted backend tokenizer's JSON
           (tok.backend_tokenizer.to_str()) to --dump so the pipeline can be inspected. The conversion imports
           torch, so this part runs where torch is installed (the GPU machine: torch 2.11, transformers 5.17,
           `gguf` installed from .whl/). A GGUF holding only the metadata (no tensors) gives the same tokenizer.

Each case records: text; ids = encode(text, add_special_tokens=False); ids_special = the same with
add_special_tokens=True; decode / decode_skip = decode(ids, skip_special_tokens=False / True) of the backend
`tokenizers` object; offsets = byte offsets [begin, end) into the UTF-8 text (from the encoding's character
offsets) for texts that NFC leaves unchanged. For smollm2 also what transformers' own tokenizer object returns
(tok(text)["input_ids"] and tok.decode) when that differs from the backend, and the converter facts
(special tokens, post-processor, decoder) in "pipeline".

Usage:
  /tmp/hfenv/bin/python scripts/tokenizer_goldens.py --only qwen3
  python3 scripts/tokenizer_goldens.py --only smollm2 --gguf .cache/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
      [--dump /tmp/smollm2_converted_tokenizer.json]
  python3 scripts/tokenizer_goldens.py --strip-gguf SRC.gguf DST.gguf
      writes a copy of SRC with all its metadata and no tensors (1.8 MB for SmolLM2 instead of 98 MB: small
      enough to carry to the GPU machine); transformers builds the same tokenizer from it. No dependencies.
Options: --only qwen3|smollm2|all (default all), --qwen3 DIR (default ../shared/tokenizers/qwen3 beside the
repository), --out-dir (default tests/fixtures/tokenizer).
"""

import argparse
import json
import os
import sys
import unicodedata
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parent.parent

LOREM = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et "
         "dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip "
         "ex ea commodo consequat. Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu "
         "fugiat nulla pariatur.")

# The hard strings (same list for every tokenizer). Keep the order stable: tests index nothing by position, but
# diffs of the fixtures stay readable.
STRINGS = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "trailing space ",
    "  two leading spaces",
    "multiple    spaces   between words",
    " ",
    "   ",
    "tab\tseparated\tvalues",
    "\t\tleading tabs and\ttrailing\t",
    " \t \t\n \t",
    "line1\nline2\n\nline4",
    "windows\r\nline\r\nendings\r\n",
    "\r\r\n\n\r",
    "\n\n\n",
    "   \n   \n",
    "end with spaces   \n",
    "I'm you're we've they'll she'd it's don't",
    "I'M YOU'RE WE'VE THEY'LL SHE'D IT'S DON'T",
    "rock'n'roll ''' 'quoted' '  's 'S 's's",
    "'\u017f '\u212a",  # long s and Kelvin sign: case-insensitive matches of 's / 'k
    "caf\u00e9 na\u00efve r\u00e9sum\u00e9 co\u00f6perate fa\u00e7ade",
    "cafe\u0301 nai\u0308ve re\u0301sume\u0301",  # NFD: NFC composes
    "\u00c5ngstr\u00f6m \u212b A\u030a",  # Angstrom sign (singleton) and A + ring
    "\u0301\u0302 starts with combining marks",
    "a\u0301\u0301\u0301 e\u0327\u0301",
    "\ufb01 ligature \u2460 \uff21\uff22\uff23",  # NFKC-only changes: NFC leaves them
    "Ti\u1ebfng Vi\u1ec7t c\u00f3 d\u1ea5u",
    "Tie\u0302\u0301ng Vie\u0323\u0302t co\u0301 da\u0302\u0301u",
    "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
    "\u1100\u1161\u11a8 \u1112\u1161\u11ab",  # conjoining jamo: NFC composes to syllables
    "\u6211\u7231\u81ea\u7136\u8bed\u8a00\u5904\u7406\u3002\u4eca\u5929\u5929\u6c14\u5f88\u597d\uff01",
    "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3001\u30ab\u30bf\u30ab\u30ca\u3068\u3072\u3089\u304c\u306a\u3002",
    "\u0645\u0631\u062d\u0628\u0627 \u0628\u0627\u0644\u0639\u0627\u0644\u0645! \u0647\u0630\u0627 \u0646\u0635 \u0639\u0631\u0628\u064a.",
    "\u0627\u0644\u0633\u0651\u064e\u0644\u064e\u0627\u0645\u064f \u0639\u064e\u0644\u064e\u064a\u0652\u0643\u064f\u0645\u0652",
    "\u05e9\u05dc\u05d5\u05dd \u05e2\u05d5\u05dc\u05dd",
    "\u041f\u0440\u0438\u0432\u0435\u0442, \u043c\u0438\u0440! \u0421\u044a\u0435\u0448\u044c \u0436\u0435 "
    "\u0435\u0449\u0451 \u044d\u0442\u0438\u0445 \u043c\u044f\u0433\u043a\u0438\u0445 \u0444\u0440\u0430\u043d"
    "\u0446\u0443\u0437\u0441\u043a\u0438\u0445 \u0431\u0443\u043b\u043e\u043a.",
    "\u0393\u03b5\u03b9\u03ac \u03c3\u03bf\u03c5 \u039a\u03cc\u03c3\u03bc\u03b5 \u03a3\u038a\u03a3\u03a5\u03a6\u039f\u03a3",
    "\u0928\u092e\u0938\u094d\u0924\u0947 \u0926\u0941\u0928\u093f\u092f\u093e",
    "\u0e2a\u0e27\u0e31\u0e2a\u0e14\u0e35\u0e0a\u0e32\u0e27\u0e42\u0e25\u0e01",
    "\u01c5 \u01c8 \u01cb \u0130stanbul \u0131i",
    "\U0001f600\U0001f603\U0001f604 \U0001f44d\U0001f3fd \U0001f468\u200d\U0001f469\u200d\U0001f467\u200d\U0001f466 "
    "\U0001f3f3\ufe0f\u200d\U0001f308 \u2764\ufe0f",
    "\U0001f1fa\U0001f1f8\U0001f1ec\U0001f1e7\U0001f1ef\U0001f1f5",
    "\U0001f44b\U0001f3fb\U0001f44b\U0001f3fc\U0001f44b\U0001f3fd\U0001f44b\U0001f3fe\U0001f44b\U0001f3ff",
    "1234567890",
    "3.14159 -42 1,000,000 1e-10 0x1F 007",
    "In 2024, 15% of 3,500 people paid $12.99.",
    "\uff11\uff12\uff13 \u0663\u0664\u0665 \u0ed1\u0ed2 \u216b x\u00b2 + y\u00b3 = z\u2074",
    "def foo(x):\n    return x**2  # square\n",
    "int main() {\n\tstd::cout << \"hi\" << std::endl;\n}\n",
    "{\"key\": [1, 2, {\"nested\": null}], \"b\": true}",
    "https://example.com/path/to/page?query=1&b=two#frag",
    "user.name+tag@example.co.uk",
    "\u2211_{i=1}^{n} i\u00b2 = n(n+1)(2n+1)/6 \u2264 \u221e",
    "# Title\n\n- item 1\n- item 2\n\n**bold** _italic_ `code`",
    "!!! ??? ... ,,, ;;; --- ___",
    "\u201cSmart quotes\u201d \u2018single\u2019 \u00abguillemets\u00bb \u201eGerman\u201c",
    "HeLLo WoRLD CamelCaseIdentifier snake_case_identifier",
    "hello\u4e16\u754c\u0645\u0631\u062d\u0628\u0627\u041f\u0440\u0438\u0432\u0435\u0442123",
    "Pneumonoultramicroscopicsilicovolcanoconiosis",
    "\x00\x01\x04\x06\x13\x1d\x7f control",
    "a\x85b\u00a0c\u2028d\u3000e\u2009f\u000bg\u000ch",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom",
    "\U000f0000\ue000\U00050000\U00050001x\U0010ffff",
    # Where the Unicode tables of tokenizers (Oniguruma: Unicode 16; NFC: Unicode 9) differ from PCRE2's / utf8proc's:
    "!\u180e! a\u180eb \u180e",  # MONGOLIAN VOWEL SEPARATOR: not white space since Unicode 6.3
    "\ua7dc\ua7cb're \U0001e5d0\U0001e5f1\U0001e5f2 \U00011f50\U00011f51 x\U0001ccf0",  # Unicode 15/16 letters, digits
    "a\u0322\u0d3c \u0d15\u0d3c\u0301 q\u0301\u1df6\u0316",  # marks newer than tokenizers' NFC tables
    "\uac00\u11a7 \uac00\u11a8 \u1100\u1161\u11a7",  # Hangul: U+11A7 is not a trailing consonant
    "\U00011935\U00011930 \U00011938",  # a composition newer than tokenizers' NFC tables
    "o" + "\u0301\u0316" * 20 + "\u0327 end",  # a long run of unordered marks
    "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n",
    "<think>\nreasoning\n</think>\n\nanswer",
    "<|endoftext|>",
    "text<|endoftext|>text<|endoftext|>",
    "<|im_start|",
    "<|im_start|><|im_end",
    "< |im_start| > <|IM_START|>",
    " <|im_start|> ",
    "<|im_start|>\u0301x",
    "\u4f60\u597d<|im_end|>\u4e16\u754c",
    "<repo_name>x<file_sep>y<jupyter_code>z<|fim_prefix|>w",
    "a" * 300,
    "ab" * 200,
    " " * 100,
    "=" * 120,
    "\n" * 50,
    "\U0001f600" * 50,
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbb",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips "
    "did Natalia sell altogether in April and May?\nNatalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    LOREM,
]


def byte_offsets(text, char_offsets):
    """tokenizers' character offsets -> byte offsets into text.encode('utf-8')."""
    pos = [0]
    for ch in text:
        pos.append(pos[-1] + len(ch.encode("utf-8")))
    return [[pos[a], pos[b]] for a, b in char_offsets]


def backend_cases(tk, strings):
    """Cases from a tokenizers.Tokenizer."""
    cases = []
    for s in strings:
        enc = tk.encode(s, add_special_tokens=False)
        ids = list(enc.ids)
        case = {
            "text": s,
            "ids": ids,
            "ids_special": list(tk.encode(s, add_special_tokens=True).ids),
            "decode": tk.decode(ids, skip_special_tokens=False),
            "decode_skip": tk.decode(ids, skip_special_tokens=True),
        }
        if unicodedata.normalize("NFC", s) == s:
            case["offsets"] = byte_offsets(s, enc.offsets)
        cases.append(case)
    return cases


def pkg_version(name):
    try:
        from importlib.metadata import version
        return version(name)
    except Exception:
        return "not installed"


def write_json(path, obj):
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(obj, ensure_ascii=True, separators=(",", ":"))
    # One case per line: small diffs, still compact.
    text = text.replace(',{"text":', ',\n{"text":')
    path.write_text(text + "\n")
    print(f"wrote {path} ({path.stat().st_size} bytes, {len(obj['cases'])} cases)")


def summarize(name, cases):
    n_ids = sum(len(c["ids"]) for c in cases)
    rt = sum(1 for c in cases if c["decode"] == c["text"])
    print(f"{name}: {len(cases)} strings, {n_ids} ids, decode(encode(s)) == s for {rt}/{len(cases)}")


def run_qwen3(args):
    from tokenizers import Tokenizer

    path = Path(args.qwen3) / "tokenizer.json"
    tk = Tokenizer.from_file(str(path))
    cases = backend_cases(tk, STRINGS)
    summarize("qwen3", cases)
    write_json(Path(args.out_dir) / "qwen3.json", {
        "tokenizer": "qwen3",
        "source": "tokenizers.Tokenizer.from_file(shared/tokenizers/qwen3/tokenizer.json)",
        "tokenizers_version": pkg_version("tokenizers"),
        "cases": cases,
    })


def run_smollm2(args):
    if not args.gguf:
        sys.exit("--gguf PATH is required for smollm2")
    gguf = Path(args.gguf).resolve()
    if not gguf.is_file():
        sys.exit(f"no such file: {gguf}")
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    backend_json = tok.backend_tokenizer.to_str()
    dump = Path(args.dump)
    dump.parent.mkdir(parents=True, exist_ok=True)
    dump.write_text(backend_json)
    print(f"wrote converted tokenizer JSON to {dump} ({len(backend_json)} bytes)")
    # Round-trip through the JSON too: the C++ side could load this file; the ids must not change.
    tk = Tokenizer.from_str(backend_json)
    cases = backend_cases(tk, STRINGS)
    mismatches = 0
    for c in cases:
        tf = [int(t) for t in tok(c["text"], add_special_tokens=False)["input_ids"]]
        tf_special = [int(t) for t in tok(c["text"], add_special_tokens=True)["input_ids"]]
        tf_plain = [int(t) for t in tok.backend_tokenizer.encode(c["text"], add_special_tokens=False).ids]
        if tf != c["ids"] or tf_plain != c["ids"]:
            c["transformers_ids"] = tf
            mismatches += 1
        if tf_special != c["ids_special"]:
            c["transformers_ids_special"] = tf_special
            mismatches += 1
        tf_dec = tok.decode(c["ids"], skip_special_tokens=False)
        if tf_dec != c["decode"]:
            c["transformers_decode"] = tf_dec
        tf_dec_skip = tok.decode(c["ids"], skip_special_tokens=True)
        if tf_dec_skip != c["decode_skip"]:
            c["transformers_decode_skip"] = tf_dec_skip
    summarize("smollm2", cases)
    print(f"smollm2: transformers ids differ from the backend tokenizer's for {mismatches} encodings")
    full = json.loads(backend_json)
    added = full.get("added_tokens", [])
    pipeline = {
        "normalizer": full.get("normalizer"),
        "pre_tokenizer": full.get("pre_tokenizer"),
        "post_processor": full.get("post_processor"),
        "decoder": full.get("decoder"),
        "model": {k: v for k, v in full["model"].items() if k not in ("vocab", "merges")},
        "added_tokens": added,
        "transformers_class": type(tok).__name__,
        "bos_token": str(tok.bos_token), "eos_token": str(tok.eos_token), "unk_token": str(tok.unk_token),
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
        "add_bos_token": getattr(tok, "add_bos_token", None),
        "clean_up_tokenization_spaces": getattr(tok, "clean_up_tokenization_spaces", None),
    }
    print("pipeline:", json.dumps({k: v for k, v in pipeline.items() if k != "added_tokens"}, ensure_ascii=False))
    print(f"added tokens: {len(added)}: {[a['content'] for a in added]}")
    write_json(Path(args.out_dir) / "smollm2.json", {
        "tokenizer": "smollm2",
        "source": f"transformers.AutoTokenizer.from_pretrained(gguf_file={gguf.name}).backend_tokenizer",
        "transformers_version": pkg_version("transformers"),
        "tokenizers_version": pkg_version("tokenizers"),
        "gguf_version": pkg_version("gguf"),
        "pipeline": pipeline,
        "cases": cases,
    })


def strip_gguf(src, dst):
    """Copy of a GGUF file (v2/v3) with its header and metadata and no tensors."""
    import struct

    b = Path(src).read_bytes()
    magic, version, _n_tensors, n_kv = struct.unpack_from("<4sIQQ", b, 0)
    if magic != b"GGUF" or version not in (2, 3):
        sys.exit(f"{src}: not a GGUF v2/v3 file")
    fixed = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(t, pos):
        if t in fixed:
            return pos + fixed[t]
        if t == 8:
            (n,) = struct.unpack_from("<Q", b, pos)
            return pos + 8 + n
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, pos)
            pos += 12
            if et in fixed:
                return pos + n * fixed[et]
            for _ in range(n):
                pos = skip(et, pos)
            return pos
        sys.exit(f"{src}: unknown metadata value type {t}")

    pos = 24
    for _ in range(n_kv):
        (n,) = struct.unpack_from("<Q", b, pos)
        pos += 8 + n
        (t,) = struct.unpack_from("<I", b, pos)
        pos = skip(t, pos + 4)
    Path(dst).write_bytes(struct.pack("<4sIQQ", magic, version, 0, n_kv) + b[24:pos])
    print(f"wrote {dst} ({pos} bytes: {n_kv} metadata keys, no tensors)")


def main():
    if len(sys.argv) == 4 and sys.argv[1] == "--strip-gguf":
        strip_gguf(sys.argv[2], sys.argv[3])
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=["qwen3", "smollm2", "all"], default="all")
    ap.add_argument("--qwen3", default=str(ROOT.parent / "shared" / "tokenizers" / "qwen3"),
                    help="directory of the Qwen3 tokenizer.json (default: %(default)s)")
    ap.add_argument("--gguf", help="SmolLM2-135M-Instruct .gguf (for smollm2)")
    ap.add_argument("--dump", default="/tmp/smollm2_converted_tokenizer.json",
                    help="where to write the converted SmolLM2 tokenizer JSON (default: %(default)s)")
    ap.add_argument("--out-dir", default=str(ROOT / "tests" / "fixtures" / "tokenizer"))
    args = ap.parse_args()
    print(f"python {sys.version.split()[0]}  tokenizers {pkg_version('tokenizers')}  "
          f"transformers {pkg_version('transformers')}")
    print(f"{len(STRINGS)} strings")
    if args.only in ("qwen3", "all"):
        run_qwen3(args)
    if args.only in ("smollm2", "all"):
        run_smollm2(args)


if __name__ == "__main__":
    main()
