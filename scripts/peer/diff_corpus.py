#!/usr/bin/env python3
"""Random differential corpus: N seeded random strings tokenized by llama.cpp.

usage (peer python): diff_corpus.py TOKENIZE_PY MODEL.gguf N SEED > out.json
Output: {"model": path, "cases": [{"text", "parse_special", "ids"}]}; the Rust test
`parity::differential_from_env` (TOKENIZER_DIFF=out.json) compares against it.
"""
import json, random, subprocess, sys, tempfile

tokenize, model, n, seed = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = random.Random(seed)
pieces = [
    lambda: rng.choice(["the", "The", "hello", "world", "don", "I", "we", "naïve", "Ångström", "x", "ABC"]),
    lambda: rng.choice(["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'", "''"]),
    lambda: "".join(rng.choice(" \t\n\r\u00a0\u3000\u2003\u0085\u000b\u000c") for _ in range(rng.randint(1, 6))),
    lambda: "".join(rng.choice("0123456789") for _ in range(rng.randint(1, 9))),
    lambda: "".join(rng.choice("٠١٢³½①Ⅻ１２") for _ in range(rng.randint(1, 3))),
    lambda: "".join(rng.choice("!\"#$%&()*+,-./:;<=>?@[\\]^_`{|}~«»—…¿¡") for _ in range(rng.randint(1, 5))),
    lambda: "".join(chr(rng.randint(0x4E00, 0x9FA5)) for _ in range(rng.randint(1, 5))),
    lambda: "".join(chr(rng.randint(0x3041, 0x30FF)) for _ in range(rng.randint(1, 5))),
    lambda: "".join(chr(rng.randint(0x0400, 0x04FF)) for _ in range(rng.randint(1, 6))),
    lambda: "".join(chr(rng.randint(0x0900, 0x097F)) for _ in range(rng.randint(1, 4))),
    lambda: rng.choice(["😀", "👨‍👩‍👧‍👦", "🇺🇸", "1️⃣", "👍🏽", "🧑‍💻", "❤️", "\u200d", "\u200b", "e\u0301"]),
    lambda: rng.choice(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<file_sep>", "<|im_", "|>", "<"]),
    lambda: "".join(chr(rng.choice([rng.randint(0x20, 0x7E), rng.randint(0xA0, 0x2FFF), rng.randint(0x1F300, 0x1FAFF), rng.randint(0x10000, 0x10FFFF)])) for _ in range(rng.randint(1, 4))),
    lambda: "    " * rng.randint(1, 3) + rng.choice(["return x", "if a:", "}", "def f():"]),
]
texts = []
for _ in range(n):
    s = "".join(rng.choice(pieces)() for _ in range(rng.randint(0, 8)))
    # no lone surrogates in Python str from chr() ranges above except 0xD800-0xDFFF: strip them
    s = "".join(c for c in s if not 0xD800 <= ord(c) <= 0xDFFF)
    texts.append({"text": s, "parse_special": rng.random() < 0.5})
with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False, encoding="utf-8") as f:
    json.dump(texts, f, ensure_ascii=False)
ids = json.loads(subprocess.run([sys.executable, tokenize, model, f.name], check=True, capture_output=True, text=True).stdout)
json.dump({"model": model, "cases": [dict(t, ids=i) for t, i in zip(texts, ids)]}, sys.stdout, ensure_ascii=False)
