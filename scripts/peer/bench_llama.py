#!/usr/bin/env python3
"""llama.cpp's side of scripts/bench-engine: the same figures as `tokenpath bench-engine`, measured
with llama-cpp-python on the same GGUF and thread count, printed as JSON on stdout.

usage: bench_llama.py MODEL.gguf [--threads 2] [--steps 32] [--prefills 3]

After one warm-up prefill of 512 tokens (as on our side), figures: prefill_512 / prefill_2048 (prompt tokens per second for one prompt of that length, in
ubatches of 512; the median of --prefills runs, as `tokenpath bench-engine --prefills` takes ours), decode_b1 (tokens per second, one sequence after a 32-token prompt), decode_b16
(aggregate tokens per second, 16 sequences decoded together through the low-level batch API —
llama.cpp's best parallel decoding). The prompt text is the same public-domain prose.
"""
import argparse, ctypes, json, sys, time

import llama_cpp

PROSE = ("Alice was beginning to get very tired of sitting by her sister on the bank, and of having "
         "nothing to do: once or twice she had peeped into the book her sister was reading, but it "
         "had no pictures or conversations in it, 'and what is the use of a book,' thought Alice "
         "'without pictures or conversations?' ")


def tokens(llm, n):
    one = llm.tokenize(PROSE.encode(), add_bos=False, special=False)
    return [one[i % len(one)] for i in range(n)]


def decode(ctx, batch_tokens, seqs, positions, want_logits):
    b = llama_cpp.llama_batch_init(len(batch_tokens), 0, 1)
    try:
        b.n_tokens = len(batch_tokens)
        for i, (t, s, p, w) in enumerate(zip(batch_tokens, seqs, positions, want_logits)):
            b.token[i] = t
            b.pos[i] = p
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = s
            b.logits[i] = w
        rc = llama_cpp.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
    finally:
        llama_cpp.llama_batch_free(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prefills", type=int, default=3)
    a = ap.parse_args()
    out = {}
    # The high-level Llama object loads the model and tokenizes; the context is made with the
    # low-level API so it can hold 16 sequences (the wrapper pins n_seq_max to 1).
    llm = llama_cpp.Llama(model_path=a.model, n_ctx=64, n_threads=a.threads, verbose=False)
    cp = llama_cpp.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 4096, 512, 512, 16
    cp.n_threads = cp.n_threads_batch = a.threads
    cp.kv_unified = True  # one 4096-cell cache shared by all sequences (the 2048 prompt needs it)
    ctx = llama_cpp.llama_init_from_model(llm.model, cp)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    mem = llama_cpp.llama_get_memory(ctx)
    # Warm-up (first touch of the weights and buffers), as on our side: one 512-token prefill.
    warm = tokens(llm, 512)
    decode(ctx, warm, [0] * 512, list(range(512)), [i == 511 for i in range(512)])
    llama_cpp.llama_memory_clear(mem, True)
    for n in (512, 2048):
        toks = tokens(llm, n)
        runs = []
        for _ in range(max(1, a.prefills)):
            llama_cpp.llama_memory_clear(mem, True)
            t = time.perf_counter()
            for s in range(0, n, 512):
                chunk = toks[s:s + 512]
                decode(ctx, chunk, [0] * len(chunk), list(range(s, s + len(chunk))),
                       [i == len(chunk) - 1 for i in range(len(chunk))])
            runs.append(n / (time.perf_counter() - t))
        out[f"prefill_{n}"] = sorted(runs)[len(runs) // 2]
    for batch in (1, 16):
        llama_cpp.llama_memory_clear(mem, True)
        prompt = tokens(llm, 32)
        seqs = [s for s in range(batch) for _ in prompt]
        decode(ctx, prompt * batch, seqs, list(range(32)) * batch, [True] * (32 * batch))
        t = time.perf_counter()
        for step in range(a.steps):
            decode(ctx, [prompt[step % 32]] * batch, list(range(batch)), [32 + step] * batch, [True] * batch)
        out[f"decode_b{batch}"] = batch * a.steps / (time.perf_counter() - t)
    out["peer"] = f"llama-cpp-python {llama_cpp.__version__}, {a.threads} threads"
    json.dump(out, sys.stdout)
    print()


if __name__ == "__main__":
    main()
