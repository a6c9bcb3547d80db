#!/usr/bin/env python3
"""Tokenize strings with llama.cpp (llama-cpp-python), the project's tokenizer oracle.

usage: llama_tokenize.py MODEL.gguf INPUT.json [--special] [--add-bos]

INPUT.json is a JSON list of strings, or a list of {"text": ..., "parse_special": bool}
objects (then each item's parse_special wins over --special). Prints a JSON list with one token
id list per input, in order. Only the vocabulary is loaded (vocab_only=True), so this is fast
and needs no memory for weights. Run it with the peer venv's python (scripts/setup-peer prints
its path).
"""
import argparse
import json
import sys

import llama_cpp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("input", help="JSON file ('-' for stdin)")
    ap.add_argument("--special", action="store_true", help="parse special tokens written in the text")
    ap.add_argument("--add-bos", action="store_true", help="add BOS/EOS as the vocabulary asks")
    args = ap.parse_args()

    src = sys.stdin if args.input == "-" else open(args.input, encoding="utf-8")
    items = json.load(src)
    if not isinstance(items, list):
        print("input must be a JSON list", file=sys.stderr)
        return 2

    llm = llama_cpp.Llama(model_path=args.model, vocab_only=True, verbose=False)
    out = []
    for item in items:
        if isinstance(item, str):
            text, special = item, args.special
        else:
            text, special = item["text"], bool(item.get("parse_special", args.special))
        out.append(llm.tokenize(text.encode("utf-8"), add_bos=args.add_bos, special=special))
    json.dump(out, sys.stdout, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
