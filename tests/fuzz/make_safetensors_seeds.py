#!/usr/bin/env python3
"""Writes the seed corpus of aloe_fuzz_safetensors (tests/fuzz/corpus/safetensors/): safetensors
files (common/safetensors.h), valid ones (F32, BF16, F16, metadata, other writers' order, the
fuzzer's tiny transformer under its spec and its GPT-2-style names) and one file per kind of
malformed one. Deterministic; rerun after changing the format or the fuzzer's model."""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus", "safetensors")


def st_file(header, data, pad=True):
    """The file of a header (a dict, or JSON text as it is) and its data bytes."""
    text = header if isinstance(header, str) else json.dumps(header, separators=(",", ":"))
    raw = text.encode()
    if pad:
        raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def f32(*values):
    return struct.pack(f"<{len(values)}f", *values)


def tensors_file(tensors, metadata=None):
    """F32 tensors [(name, shape, values)] in the order given, as ALOE writes them."""
    header = {}
    if metadata:
        header["__metadata__"] = metadata
    data = b""
    for name, shape, values in tensors:
        header[name] = {"dtype": "F32", "shape": shape,
                        "data_offsets": [len(data), len(data) + 4 * len(values)]}
        data += f32(*values)
    return st_file(header, data)


# The fuzzer's model (tiny transformer: V = 4, S = 2, d = 2, one block, f = 2), in the layout of
# common/model_spec.h.
V, S, D, F = 4, 2, 2, 2
SPEC = [
    ("tok_emb.weight", [V, D], "transformer.wte.weight"),
    ("pos_emb.weight", [S, D], "transformer.wpe.weight"),
    ("blocks.0.ln1.weight", [D], "transformer.h.0.ln_1.weight"),
    ("blocks.0.ln1.bias", [D], "transformer.h.0.ln_1.bias"),
    ("blocks.0.attn.qkv.weight", [3 * D, D], "transformer.h.0.attn.c_attn.weight"),
    ("blocks.0.attn.qkv.bias", [3 * D], "transformer.h.0.attn.c_attn.bias"),
    ("blocks.0.attn.proj.weight", [D, D], "transformer.h.0.attn.c_proj.weight"),
    ("blocks.0.attn.proj.bias", [D], "transformer.h.0.attn.c_proj.bias"),
    ("blocks.0.ln2.weight", [D], "transformer.h.0.ln_2.weight"),
    ("blocks.0.ln2.bias", [D], "transformer.h.0.ln_2.bias"),
    ("blocks.0.mlp.fc1.weight", [F, D], "transformer.h.0.mlp.c_fc.weight"),
    ("blocks.0.mlp.fc1.bias", [F], "transformer.h.0.mlp.c_fc.bias"),
    ("blocks.0.mlp.fc2.weight", [D, F], "transformer.h.0.mlp.c_proj.weight"),
    ("blocks.0.mlp.fc2.bias", [D], "transformer.h.0.mlp.c_proj.bias"),
    ("ln_f.weight", [D], "transformer.ln_f.weight"),
    ("ln_f.bias", [D], "transformer.ln_f.bias"),
    ("head.weight", [V, D], "lm_head.weight"),
]


def model(gpt2_names, nan_at=None):
    tensors = []
    k = 0
    for name, shape, gpt2 in SPEC:
        n = 1
        for d in shape:
            n *= d
        values = [0.25 * ((k + i) % 7) - 0.5 for i in range(n)]
        k += n
        tensors.append((gpt2 if gpt2_names else name, shape, values))
    if nan_at is not None:
        tensors[nan_at][2][0] = float("nan")
    return tensors_file(tensors)


GOOD = {"t": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
GOOD_FILE = st_file(GOOD, f32(1, 2))
BF16_F16 = st_file('{"h":{"dtype":"F16","shape":[2],"data_offsets":[4,8]},'
                   '"b":{"dtype":"BF16","shape":[2],"data_offsets":[0,4]}}',
                   struct.pack("<4H", 0x3FC0, 0xC000, 0x3E00, 0x0001))


def one(entry, data=f32(1, 2)):
    return st_file({"t": entry}, data)


SEEDS = {
    "valid_f32": tensors_file([("w", [2, 2], [1, 2, 3, 4]), ("b", [], [7])]),
    "valid_metadata": tensors_file([("a", [2], [1.5, -2])], {"format": "pt", "k": "v"}),
    "valid_bf16_f16_other_order": BF16_F16,
    "valid_empty_tensors": tensors_file([("e", [0, 3], []), ("x", [1], [3]), ("z", [4, 0], [])]),
    "valid_no_tensors": st_file("{}", b""),
    "valid_unpadded_escaped_name": st_file(
        '{"a\\"b\\u00e9\\n":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', f32(9),
        pad=False),
    "valid_model_spec_names": model(False),
    "valid_model_gpt2_names": model(True),
    "model_nan": model(True, nan_at=3),
    "model_missing_tensor": tensors_file([(n, s, [0.0] * (s[0] * (s[1] if len(s) > 1 else 1)))
                                          for n, s, _ in SPEC[1:]]),
    "truncated_length": b"\x10\x00\x00",
    "truncated_header": GOOD_FILE[:20],
    "truncated_data": GOOD_FILE[:-3],
    "header_too_long": struct.pack("<Q", 1 << 40) + b"{}",
    "not_json": st_file("{not json", f32(1, 2)),
    "not_an_object": st_file("[1,2]", b""),
    "entry_not_object": st_file('{"t":3}', b""),
    "metadata_not_string": st_file('{"__metadata__":{"k":1}}', b""),
    "unknown_dtype": one({"dtype": "I64", "shape": [1], "data_offsets": [0, 8]}),
    "shape_mismatch": one({"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}),
    "negative_dim": one({"dtype": "F32", "shape": [-1], "data_offsets": [0, 8]}),
    "fractional_dim": one({"dtype": "F32", "shape": [1.5], "data_offsets": [0, 8]}),
    "offsets_reversed": one({"dtype": "F32", "shape": [2], "data_offsets": [8, 0]}),
    "three_offsets": one({"dtype": "F32", "shape": [2], "data_offsets": [0, 8, 8]}),
    "no_dtype": one({"shape": [2], "data_offsets": [0, 8]}),
    "overlap": st_file({"t": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                        "u": {"dtype": "F32", "shape": [1], "data_offsets": [2, 6]}}, f32(1, 2)),
    "past_the_end": one({"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}),
    "shape_product_wraps": one({"dtype": "F32", "shape": [2147483648, 2147483648],
                                "data_offsets": [0, 0]}),
}

os.makedirs(OUT, exist_ok=True)
for name, data in SEEDS.items():
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(data)
print(f"{len(SEEDS)} seeds in {OUT}")
