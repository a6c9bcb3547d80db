#!/usr/bin/env bash
# Regenerates the llama.cpp ground-truth fixtures from the corpus, using the peer
# (scripts/setup-peer) and the project's scripts/peer/llama_tokenize.py:
#   tests/fixtures/tokenizer_parity.json       [{text, parse_special, ids}]
#   tests/fixtures/chat_template_expected.json [{messages, add_generation_prompt, expected}]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
main="${TOKENPATH_MAIN:-/work/main}"
# shellcheck source=/dev/null
source "$main/scripts/lib.sh"
py="$("$main/scripts/setup-peer")"
fx="$here/tests/fixtures"
"$py" - "$main/scripts/peer/llama_tokenize.py" "$TOKENPATH_MODEL" "$fx" <<'PY'
import json, subprocess, sys
tokenize, model, fx = sys.argv[1:]
corpus = json.load(open(f"{fx}/tokenizer_corpus.json", encoding="utf-8"))
ids = json.loads(subprocess.run([sys.executable, tokenize, model, f"{fx}/tokenizer_corpus.json"],
                                check=True, capture_output=True, text=True).stdout)
out = [{"text": c["text"], "parse_special": c["parse_special"], "ids": i} for c, i in zip(corpus, ids)]
json.dump(out, open(f"{fx}/tokenizer_parity.json", "w", encoding="utf-8"), ensure_ascii=False, indent=1)
print(f"tokenizer_parity.json: {len(out)} cases", file=sys.stderr)

# Chat template: rendered the way HF apply_chat_template does (Jinja2 sandbox, trim/lstrip blocks).
import llama_cpp
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.exceptions import TemplateError
llm = llama_cpp.Llama(model_path=model, vocab_only=True, verbose=False)
meta = llm.metadata
src = meta["tokenizer.chat_template"]
tok = lambda k: llm._model.token_get_text(int(meta[k])) if k in meta else ""
def raise_exception(msg):
    raise TemplateError(msg)
env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
env.globals["raise_exception"] = raise_exception
t = env.from_string(src)
cases = [
    ([{"role": "user", "content": "hi"}], True),
    ([{"role": "user", "content": "hi"}], False),
    ([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}], True),
    ([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c\n\nd "}], True),
    ([{"role": "user", "content": "你好 😀"}], True),
    ([], True),
]
out = []
for msgs, agp in cases:
    out.append({"messages": msgs, "add_generation_prompt": agp,
                "expected": t.render(messages=msgs, add_generation_prompt=agp,
                                     bos_token=tok("tokenizer.ggml.bos_token_id"),
                                     eos_token=tok("tokenizer.ggml.eos_token_id"))})
json.dump(out, open(f"{fx}/chat_template_expected.json", "w", encoding="utf-8"), ensure_ascii=False, indent=1)
print(f"chat_template_expected.json: {len(out)} cases", file=sys.stderr)
PY
