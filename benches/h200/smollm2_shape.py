#!/usr/bin/env python3
"""Writes a LLaMA with SmolLM2-135M's exact shape and random f16 weights, for speed runs on a
machine the real model cannot reach (the H200 lab has no network and a 64 MiB upload limit).

    python3 benches/h200/smollm2_shape.py OUT_DIR

Shape (SmolLM2-135M-Instruct's config.json): hidden 576, intermediate 1536, 30 layers, 9 query
heads and 3 KV heads of 64, vocab 49152, tied embeddings, RoPE theta 100000. The decoder's speed
depends on these shapes and on the weight policy, not on the values, so tg/pp figures from this
file stand for the real model's; quality figures (perplexity, greedy text) need the real one.
"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
cfg = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)
with torch.device("meta"):
    model = LlamaForCausalLM(cfg)
model = model.to_empty(device="cpu")
with torch.no_grad():
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.02)
model.half().save_pretrained(sys.argv[1], safe_serialization=True)
