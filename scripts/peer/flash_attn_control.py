#!/usr/bin/env python3
"""llama.cpp against itself: greedy continuations with flash attention on, compared with the
fixture greedy.py wrote (flash attention off). Both are correct; they only round differently.

usage: flash_attn_control.py MODEL.gguf FIXTURE.json

Prints how many of the fixture's continuations llama.cpp reproduces with its other attention
path and the largest first-step logit difference (top-50 ids): the noise floor any engine that
does not reproduce ggml's exact arithmetic is measured against.
"""
import json, sys

import numpy as np
import llama_cpp


def main():
    model, fixture = sys.argv[1], sys.argv[2]
    fx = json.load(open(fixture))
    llm = llama_cpp.Llama(model_path=model, n_ctx=4096, n_threads=2, n_batch=512, flash_attn=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    same, first_diff = 0, 0.0
    for c in fx["cases"]:
        llm.reset()
        llm.eval(c["prompt_ids"])
        out = []
        for step in range(len(c["continuation"]) + 1):
            ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
            logits = np.ctypeslib.as_array(ptr, shape=(llm.n_vocab(),)).astype(np.float32)
            if step == 0:
                first_diff = max(first_diff, max(abs(float(logits[i]) - v) for i, v in c["first_step_top"]))
            nxt = int(np.argmax(logits))
            if llama_cpp.llama_vocab_is_eog(vocab, nxt) or len(out) == len(c["continuation"]):
                break
            out.append(nxt)
            llm.eval([nxt])
        same += out == c["continuation"]
    print(f"llama.cpp flash attention vs its default path: greedy identical {same}/{len(fx['cases'])}; "
          f"max first-step logit difference (top-50 ids) {first_diff:.3f}")


if __name__ == "__main__":
    main()
