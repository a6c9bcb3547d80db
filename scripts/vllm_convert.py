"""The GGUF model as the Hugging Face directory vLLM serves (scripts/setup-vllm-cpu), offline.

    python scripts/vllm_convert.py MODEL.gguf OUT_DIR

transformers' GGUF loader dequantizes the Q4_1/Q8_0 tensors (fp32 here). A GGUF-loaded model
refuses `save_pretrained` ("quantized with QuantizationMethod.GGUF and is not serializable"),
so the state dict is moved into a plain `LlamaForCausalLM` built from the same config without
its `quantization_config`, and that is saved: safetensors, config (tied embeddings: the GGUF has
no `output.weight`), tokenizer, chat template, generation config. Then a greedy check: the model
must continue "The capital of France is" with " Paris", and the saved directory must load back.
Run with HF_HUB_OFFLINE=1: nothing is fetched.
"""

import os
import sys


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    gguf_path, out = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, LlamaForCausalLM

    torch.set_num_threads(1)
    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    assert config.model_type == "llama", config.model_type
    model = LlamaForCausalLM(config).to(torch.float32)
    result = model.load_state_dict(loaded.state_dict(), strict=False)
    # Tied embeddings: lm_head.weight is the embedding matrix, present or not in the state dict.
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]
    if missing or result.unexpected_keys:
        sys.exit(f"state dict mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    model.tie_weights()
    model.eval()
    del loaded

    gen = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id
    )
    model.generation_config = gen
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    if not (os.path.exists(os.path.join(out, "chat_template.jinja")) or tok.chat_template):
        sys.exit("the GGUF's tokenizer has no chat template")

    # Greedy sanity check on the saved directory, loaded back as vLLM will load it.
    back_tok = AutoTokenizer.from_pretrained(out)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = back_tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        got = back.generate(ids, max_new_tokens=4, do_sample=False)
    text = back_tok.decode(got[0, ids.shape[1]:])
    print(f"greedy: 'The capital of France is' -> {text!r}", file=sys.stderr)
    if not text.startswith(" Paris"):
        sys.exit(f"the converted model continues with {text!r}, expected ' Paris'")
    c = back.config
    print(
        f"saved {out}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, heads {c.num_attention_heads}"
        f"/{c.num_key_value_heads} kv, vocab {c.vocab_size}, tied {c.tie_word_embeddings}",
        file=sys.stderr,
    )


if __name__ == "__main__":
    main()
