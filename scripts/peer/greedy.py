#!/usr/bin/env python3
"""Greedy continuations from llama.cpp (llama-cpp-python), the engine's correctness oracle.

usage: greedy.py MODEL.gguf PROMPTS.json OUT.json [--steps 64] [--top 50]

PROMPTS.json is a list of {"name", "messages": [{role, content}]} or {"name", "text"}. Chat
prompts are rendered with the model's own template by llama-cpp-python's Jinja renderer, then
tokenized by llama.cpp, so the fixture pins llama.cpp's token ids; our engine is then fed exactly
those ids. For each prompt OUT.json records: the prompt ids, the greedy continuation (stopping
early at an end-of-generation token), the top-`--top` logits of the first step, and the top two
(id, logit) pairs at every step (to tell a rounding near-tie from a real divergence).
"""
import argparse, json, sys

import numpy as np
import llama_cpp
from llama_cpp.llama_chat_format import Jinja2ChatFormatter


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("prompts")
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--top", type=int, default=50)
    a = ap.parse_args()
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=4096, n_threads=2, n_batch=512, verbose=False)
    meta = llm.metadata
    tmpl = meta.get("tokenizer.chat_template")
    tok_text = lambda i: llm.detokenize([i], special=True).decode("utf-8", "replace")
    eos = tok_text(llm.token_eos())
    bos = tok_text(llm.token_bos())
    fmt = Jinja2ChatFormatter(template=tmpl, eos_token=eos, bos_token=bos) if tmpl else None
    cases = []
    for p in json.load(open(a.prompts)):
        if "messages" in p:
            text = fmt(messages=p["messages"]).prompt
        else:
            text = p["text"]
        ids = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(ids)
        out, steps, first_top = [], [], None
        for step in range(a.steps):
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)
            order = np.argsort(-logits, kind="stable")
            if step == 0:
                first_top = [[int(i), float(logits[i])] for i in order[: a.top]]
            steps.append([[int(order[0]), float(logits[order[0]])], [int(order[1]), float(logits[order[1]])]])
            nxt = int(order[0])
            if llama_cpp.llama_vocab_is_eog(llama_cpp.llama_model_get_vocab(llm.model), nxt):
                break
            out.append(nxt)
            llm.eval([nxt])
        cases.append({"name": p.get("name", ""), "prompt_ids": ids, "continuation": out,
                      "first_step_top": first_top, "step_top2": steps})
        print(f"{p.get('name','')}: {len(ids)} prompt tokens, {len(out)} generated", file=sys.stderr)
    json.dump({"model": a.model.split("/")[-1], "peer": f"llama-cpp-python {llama_cpp.__version__}",
               "cases": cases}, open(a.out, "w"))


if __name__ == "__main__":
    main()
