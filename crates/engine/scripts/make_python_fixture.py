"""Writes tests/data/python_fixture.gguf with the reference `gguf` Python package (gguf-py, from
llama.cpp): random blocks of every supported type plus, for each, the F32 tensor that gguf-py's
own dequantizer produces. The Rust test `python_fixture` parses this independently written file
and checks our dequantization against gguf-py's. Regenerate with:
    pip install gguf numpy && python3 crates/engine/scripts/make_python_fixture.py
"""
import pathlib
import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize

rng = np.random.default_rng(1234)
out = pathlib.Path(__file__).resolve().parent.parent / "tests" / "data" / "python_fixture.gguf"
w = gguf.GGUFWriter(str(out), arch="llama")
w.add_uint32("fixture.version", 1)
w.add_array("fixture.strings", ["a", "bc", ""])


def f16(x):
    return np.array([x], dtype=np.float16).view(np.uint8)


def blocks(ty, n):
    block, size = gguf.GGML_QUANT_SIZES[ty]
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    for b in raw:  # keep scales finite and modest
        if ty in (T.Q4_0, T.Q8_0):
            b[0:2] = f16(rng.uniform(-0.1, 0.1))
        elif ty == T.Q4_1:
            b[0:2] = f16(rng.uniform(0, 0.1)); b[2:4] = f16(rng.uniform(-1, 1))
        elif ty == T.Q4_K:
            b[0:2] = f16(rng.uniform(0, 0.02)); b[2:4] = f16(rng.uniform(0, 0.02))
        elif ty == T.Q6_K:
            b[208:210] = f16(rng.uniform(-0.01, 0.01))
    return raw, block


for ty, rows in [(T.Q4_0, 3), (T.Q4_1, 3), (T.Q8_0, 3), (T.Q4_K, 2), (T.Q6_K, 2)]:
    cols = 512
    block, size = gguf.GGML_QUANT_SIZES[ty]
    raw, _ = blocks(ty, rows * cols // block)
    raw = raw.reshape(rows, cols // block * size)
    w.add_tensor(f"{ty.name}", raw, raw_dtype=ty)
    w.add_tensor(f"{ty.name}.expected", dequantize(raw, ty).astype(np.float32))
half = rng.standard_normal((2, 64)).astype(np.float16)
w.add_tensor("F16", half)
w.add_tensor("F16.expected", half.astype(np.float32))
w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
print("wrote", out, out.stat().st_size, "bytes")
