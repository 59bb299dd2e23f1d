#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpora into seeds/<target>/ (standard library only).

Run from this directory: python3 make_seeds.py. Deterministic; the seeds are small valid (and a
few truncated) inputs, so the fuzzers start from the formats' real structure. Files named
regression-* are inputs the fuzzers found that once failed (kept by hand, not written here).
"""
import json
import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def out(target, name, data):
    d = os.path.join(HERE, "seeds", target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def gguf_string(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def gguf_kv(key, kind, value):
    head = gguf_string(key) + struct.pack("<I", kind)
    if kind == 4:  # u32
        return head + struct.pack("<I", value)
    if kind == 6:  # f32
        return head + struct.pack("<f", value)
    if kind == 8:  # string
        return head + gguf_string(value)
    if kind == 9:  # array: (element kind, items)
        elem, items = value
        body = struct.pack("<IQ", elem, len(items))
        for it in items:
            body += gguf_string(it) if elem == 8 else struct.pack("<i", it)
        return head + body
    raise ValueError(kind)


MX_TYPE_BASE = 0x4D580000  # pipeline quantize's MX tensor types (gguf::MX_TYPE_BASE)
MX_FP4 = MX_TYPE_BASE + 4  # 17-byte blocks: the E8M0 scale, then 16 bytes of codes


def minimal_gguf(h=8, ff=16, mx=False):
    """A one-layer llama; with mx, 32-wide, attn_q and ffn_down as MXFP4 blocks, attn_q listed as
    block-rotated, and a recorded policy (what pipeline quantize writes)."""
    vocab = 3
    kvs = [
        ("general.architecture", 8, "llama"),
        ("llama.block_count", 4, 1),
        ("llama.embedding_length", 4, h),
        ("llama.feed_forward_length", 4, ff),
        ("llama.attention.head_count", 4, 2),
        ("llama.attention.head_count_kv", 4, 1),
        ("llama.attention.layer_norm_rms_epsilon", 6, 1e-5),
        ("llama.context_length", 4, 64),
        ("tokenizer.ggml.model", 8, "gpt2"),
        ("tokenizer.ggml.tokens", 9, (8, ["a", "b", "ab"])),
        ("tokenizer.ggml.merges", 9, (8, ["a b"])),
        ("tokenizer.ggml.token_type", 9, (5, [1, 1, 1])),
        ("tokenizer.chat_template", 8, "{% for m in messages %}{{ m['content'] }}{% endfor %}"),
    ]
    if mx:
        kvs += [
            ("pipeline.quantize.policy", 8, "fp4"),
            ("pipeline.quantize.block_rotation", 9, (8, ["blk.0.attn_q.weight"])),
        ]
    mx_tensors = {"blk.0.attn_q.weight", "blk.0.ffn_down.weight"} if mx else set()
    q, kv = 2 * (h // 2), 1 * (h // 2)
    tensors = [("token_embd.weight", [h, vocab]), ("output_norm.weight", [h])]
    for n, dims in [("attn_norm", [h]), ("attn_q", [h, q]), ("attn_k", [h, kv]),
                    ("attn_v", [h, kv]), ("attn_output", [q, h]), ("ffn_norm", [h]),
                    ("ffn_gate", [h, ff]), ("ffn_up", [h, ff]), ("ffn_down", [ff, h])]:
        tensors.append((f"blk.0.{n}.weight", dims))
    body = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kvs))
    for k, t, v in kvs:
        body += gguf_kv(k, t, v)
    offset = 0
    data = b""
    for name, dims in tensors:
        body += gguf_string(name) + struct.pack("<I", len(dims))
        body += b"".join(struct.pack("<Q", d) for d in dims)
        n = 1
        for d in dims:
            n *= d
        if name in mx_tensors:
            body += struct.pack("<IQ", MX_FP4, offset)
            chunk = b"".join(bytes([120 + b % 8]) + bytes((b * 7 + i) % 256 for i in range(16))
                             for b in range(n // 32))
        else:
            body += struct.pack("<IQ", 0, offset)  # f32
            chunk = b"".join(struct.pack("<f", ((i * 37) % 17) / 17.0 - 0.5) for i in range(n))
        chunk += b"\0" * (-len(chunk) % 32)
        data += chunk
        offset += len(chunk)
    body += b"\0" * (-len(body) % 32)
    return body + data


g = minimal_gguf()
out("gguf", "minimal.gguf", g)
out("gguf", "truncated.gguf", g[: len(g) // 3])
out("gguf", "quantized-mx.gguf", minimal_gguf(32, 64, mx=True))

# pipeline quantize --hessians: magic, key, tokens, batches, inputs; per input its width, the
# matrices reading it and the lower triangle of X^T X (f64).
key = b"fuzz"
cal = b"PQCAL\x00\x00\x01" + struct.pack("<Q", len(key)) + key + struct.pack("<QQQ", 64, 1, 1)
cal += struct.pack("<QQ", 32, 2)
for name in [b"blk.0.attn_k", b"blk.0.attn_q"]:
    cal += struct.pack("<Q", len(name)) + name
cal += b"".join(struct.pack("<d", 1.0 if c == r else 0.01) for r in range(32) for c in range(r + 1))
out("calibration", "one-input.bin", cal)
out("calibration", "truncated.bin", cal[: len(cal) // 2])

config = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 8, "intermediate_size": 16,
    "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5, "vocab_size": 3, "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}
cfg = json.dumps(config).encode()
header = json.dumps({"model.embed_tokens.weight": {"dtype": "F32", "shape": [3, 8],
                     "data_offsets": [0, 96]}}).encode()
st = struct.pack("<Q", len(header)) + header + b"\0" * 96
out("safetensors_config", "llama.bin", struct.pack("<H", len(cfg)) + cfg + st)

y4m = b"YUV4MPEG2 W8 H4 F30:1 Ip A1:1 C420jpeg\n" + b"FRAME\n" + bytes(range(48))
out("y4m", "two_frames.y4m", y4m + b"FRAME\n" + bytes(48))
out("y4m", "c444.y4m", b"YUV4MPEG2 W4 H2 F25:1 C444\nFRAME\n" + bytes(24))

npy_header = "{'descr': '<f4', 'fortran_order': False, 'shape': (1, 3, 16, 16), }"
npy_header = npy_header + " " * (-(len(npy_header) + 11) % 64) + "\n"
npy = b"\x93NUMPY\x01\x00" + struct.pack("<H", len(npy_header)) + npy_header.encode()
out("npy", "pixels.npy", npy + struct.pack("<768f", *[(i % 7) / 7.0 for i in range(768)]))

schema = {"type": "object", "properties": {"a": {"type": "integer"},
          "b": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 3}},
          "required": ["a"]}
out("grammar", "schema.json", b"\x00" + json.dumps(schema).encode())
out("grammar", "regex.txt", b"\x01" + b"(yes|no), [0-9]{2}")
out("grammar", "answer.lark", b"\x02" + b'start: answer ", " count\nanswer: "yes" | "no"\ncount: /[0-9]+/\n')
out("grammar", "nested.json", b"\x00" + json.dumps(
    {"type": "array", "items": {"type": "array", "items": {"type": "boolean"}}}).encode())

out("chat_template", "chatml.jinja",
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
out("chat_template", "loops.jinja",
    "{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
    "{{ m.role | upper }}: {{ m.content | trim }}{% endfor %}{{ eos_token }}")
