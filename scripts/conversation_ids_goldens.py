#!/usr/bin/env python3
"""Token ids of whole conversations, as transformers' apply_chat_template(tokenize=True) gives them with
the real Qwen3 tokenizer: the end-to-end golden for `dflash tokenize --chat` and `dflash prepare`.

Runs on the dev machine with transformers + tokenizers (no torch needed), e.g. in a venv:
  python3 -m venv /tmp/hfenv && /tmp/hfenv/bin/pip install transformers==5.17.0 tokenizers jinja2
  /tmp/hfenv/bin/python scripts/conversation_ids_goldens.py
Reads the conversations of tests/fixtures/chat/qwen3.json (every message list and option set there) and
writes tests/fixtures/chat/qwen3_ids.json: [{"name", "messages", "options", "ids"}].
"""
import argparse
import json
from pathlib import Path

from transformers import AutoTokenizer

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", default=str(ROOT.parent / "shared" / "tokenizers" / "qwen3"))
    ap.add_argument("--chat", default=str(ROOT / "tests" / "fixtures" / "chat" / "qwen3.json"))
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures" / "chat" / "qwen3_ids.json"))
    args = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    cases = []
    for conv in json.load(open(args.chat))["conversations"]:
        for r in conv["renders"]:
            if "text" not in r:  # an expected-error render
                continue
            opts = {k: v for k, v in r.items() if k != "text"}
            kw = dict(opts)
            ids = tok.apply_chat_template(conv["messages"], tokenize=True, **kw)
            if isinstance(ids, dict) or hasattr(ids, "keys"):
                ids = ids["input_ids"]
            text = tok.apply_chat_template(conv["messages"], tokenize=False, **kw)
            assert text == r["text"], f"{conv['name']}: template text differs from the chat golden"
            cases.append({"name": conv["name"], "messages": conv["messages"], "options": opts, "ids": list(map(int, ids))})
    Path(args.out).write_text(json.dumps({"tokenizer": "qwen3", "cases": cases}, ensure_ascii=False) + "\n")
    print(f"wrote {args.out}: {len(cases)} conversations x options")


if __name__ == "__main__":
    main()
