#!/usr/bin/env python3
"""Chat-template goldens: the real Jinja templates of tests/fixtures/chat/templates rendered by transformers.

For every template (see TEMPLATES) and every conversation x option set below, renders the text with
transformers' own renderer, `transformers.utils.chat_template_utils.render_jinja_template` (what
`apply_chat_template(tokenize=False)` calls, with the tokenizer's special tokens passed the same way), and
writes tests/fixtures/chat/<name>.json:

  {"template": "templates/<file>.jinja", "family": "<--chat-template name>", "transformers": "<version>",
   "conversations": [{"name", "messages",
                      "renders": [{"add_generation_prompt", "enable_thinking"?, "text" | "error"}]}]}

A render that raises (the Qwen3.5 templates reject a conversation without a user query or with a
late system message) gets "error" (the exception text) instead of "text". enable_thinking is passed only
when the render sets it (so "is defined" tests in the templates see it exactly as given).

Llama 3.2's template writes "Today Date" with strftime_now (today's date under transformers); its cases
pass date_string="26 Jul 2024", the date Llama 3.1/3.3's template uses when date_string is not given, which
is what dflash renders.

Needs transformers and jinja2 only (no torch). Usage: python3 scripts/chat_goldens.py [--out DIR]
"""

import argparse
import json
from pathlib import Path

import transformers
from transformers.utils.chat_template_utils import render_jinja_template

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "chat"

LLAMA_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
QWEN_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
SMOL_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<|endoftext|>"}

# golden name -> (template file, family, special tokens, extra template kwargs)
TEMPLATES = {
    "qwen3": ("qwen3.jinja", "qwen3", QWEN_TOKENS, {}),
    "qwen3.5": ("qwen3.5-27b.jinja", "qwen3.5", QWEN_TOKENS, {}),
    "qwen3.6": ("qwen3.6-27b.jinja", "qwen3.5", QWEN_TOKENS, {}),
    "qwen3.5-0.8b": ("qwen3.5-0.8b.jinja", "qwen3.5-nothink", QWEN_TOKENS, {}),
    "smollm2": ("smollm2.jinja", "smollm2", SMOL_TOKENS, {}),
    "chatml": ("chatml.jinja", "chatml", {"eos_token": "<|im_end|>"}, {}),
    "llama3": ("llama3.jinja", "llama3", LLAMA_TOKENS, {}),
    "llama3.1": ("llama3.3-70b.jinja", "llama3.1", LLAMA_TOKENS, {}),
    "llama3.2": ("llama3.2-3b.jinja", "llama3.1", LLAMA_TOKENS, {"date_string": "26 Jul 2024"}),
}


def sys_(c):
    return {"role": "system", "content": c}


def user(c):
    return {"role": "user", "content": c}


def asst(c, reasoning=None):
    m = {"role": "assistant", "content": c}
    if reasoning is not None:
        m["reasoning_content"] = reasoning
    return m


CONVERSATIONS = {
    "single_user": [user("Hello!")],
    "system_user": [sys_("You are terse."), user("What is 2+2?")],
    "system_user_assistant": [sys_("You are terse."), user("What is 2+2?"), asst("4")],
    "multi_turn_system": [
        sys_("You are a helpful assistant."), user("Hi."), asst("Hello! How can I help?"),
        user("Name a prime."), asst("7"), user("Another one?"),
    ],
    "multi_turn_no_system": [user("a"), asst("b"), user("c"), asst("d")],
    "unicode": [
        sys_("Réponds en français. 日本語も可。"), user("Ça va? 🙂 Привет! \u00a0"),
        asst("\u3000Très bien, merci 👍 — 谢谢\u2028"),
    ],
    "empty_system": [sys_(""), user("Hi")],
    "empty_contents": [user(""), asst("")],
    "whitespace_edges": [
        sys_("  \n system with spaces \n\n"), user("\n\n  user text  \n"), asst("\n  answer with edges  \n\n"),
    ],
    "think_inline_last": [user("Why?"), asst("<think>\nBecause.\n</think>\n\nThe answer.")],
    "think_inline_history": [
        user("q1"), asst("<think>\nr1\n</think>\n\na1"), user("q2"), asst("<think>\n\nr2 \n\n</think>\n\n\na2"),
    ],
    "think_inline_history_user_last": [user("q1"), asst("<think>r1</think>a1"), user("q2")],
    "reasoning_field_last": [user("q"), asst("The answer.", reasoning="\nStep 1.\nStep 2.\n")],
    "reasoning_field_history": [
        sys_("S"), user("q1"), asst("a1", reasoning="r1"), user("q2"), asst("a2", reasoning="  r2  "),
    ],
    "reasoning_field_empty": [user("q"), asst("<think>kept?</think>a", reasoning="")],
    "two_assistants_after_query": [user("q"), asst("part one", reasoning="think one"), asst("part two")],
    "two_assistants_no_reasoning": [user("q"), asst("part one"), asst("part two")],
    "think_multiple_close": [user("q"), asst("<think>a</think>b</think>\nc")],
    "think_open_only": [user("q"), asst("<think>unfinished thought")],
    "tool_response_user_last": [
        user("real query"), asst("calling"), user("<tool_response>\n42\n</tool_response>"),
    ],
    "system_not_first": [user("u1"), sys_("late system"), user("u2")],
    "no_user": [sys_("S"), asst("orphan answer")],
    "assistant_only": [asst("just me")],
    "long_multi_turn": [
        sys_("Be precise."), user("1"), asst("one"), user("2"), asst("<think>\nhmm\n</think>\n\ntwo"),
        user("3"), asst("three", reasoning="counting"), user("4"), asst("four"),
    ],
}

OPTIONS = [
    {"add_generation_prompt": False},
    {"add_generation_prompt": True},
    {"add_generation_prompt": True, "enable_thinking": False},
    {"add_generation_prompt": True, "enable_thinking": True},
]


def render(template, messages, opt, tokens, extra):
    kwargs = {**tokens, **extra}
    if "enable_thinking" in opt:
        kwargs["enable_thinking"] = opt["enable_thinking"]
    out = render_jinja_template(
        conversations=[messages], chat_template=template, add_generation_prompt=opt["add_generation_prompt"], **kwargs
    )
    return out[0][0] if isinstance(out, tuple) else out[0]


def build(name, out_dir):
    file, family, tokens, extra = TEMPLATES[name]
    template = (FIXTURES / "templates" / file).read_text()
    conversations = []
    for conv_name, messages in CONVERSATIONS.items():
        renders = []
        for opt in OPTIONS:
            r = dict(opt)
            try:
                r["text"] = render(template, messages, opt, tokens, extra)
            except Exception as e:  # the template's raise_exception (TemplateError)
                r["error"] = str(e)
            renders.append(r)
        conversations.append({"name": conv_name, "messages": messages, "renders": renders})
    doc = {
        "template": f"templates/{file}",
        "family": family,
        "transformers": transformers.__version__,
        "conversations": conversations,
    }
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
    n = sum(len(c["renders"]) for c in conversations)
    errors = sum("error" in r for c in conversations for r in c["renders"])
    print(f"{path}: {len(conversations)} conversations, {n} renders ({errors} expected errors)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=FIXTURES)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for name in TEMPLATES:
        build(name, args.out)


if __name__ == "__main__":
    main()
