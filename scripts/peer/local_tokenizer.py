"""Writes a small Hugging Face tokenizer directory that loads with no network.

guidellm's synthetic data needs a tokenizer (AutoTokenizer.from_pretrained) to cut prompts to an
exact token count, and by default it asks the Hugging Face hub for the served model's one; this
machine reaches no hub. The fake server of scripts/bench-client has no model, so any real
byte-level BPE will do: this trains one (vocab 2,000) on the public-domain prose the bench ships
(crates/bench/src/text.rs) and saves it as a PreTrainedTokenizerFast.

    python local_tokenizer.py OUT_DIR REPO_ROOT      # idempotent: keeps an existing OUT_DIR
"""

import os
import re
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast


def main() -> None:
    out, root = sys.argv[1], sys.argv[2]
    if os.path.exists(os.path.join(out, "tokenizer.json")):
        print(out)
        return
    src = open(os.path.join(root, "crates/bench/src/text.rs"), encoding="utf-8").read()
    m = re.search(r'PRIDE_AND_PREJUDICE: &str = "(.*?)";\n', src, re.S)
    text = m.group(1).replace('\\"', '"') if m else src
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([text] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
