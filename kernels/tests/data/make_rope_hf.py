#!/usr/bin/env python3
"""Inverse frequencies and attention factors of every `rope_type` as transformers computes them
(`modeling_rope_utils.ROPE_INIT_FUNCTIONS`), for `kernels/tests/ops_rope_hf.rs`.

    python3 kernels/tests/data/make_rope_hf.py > kernels/tests/data/rope_hf.txt

One case per line: `name head_dim base seq_len attention_factor inv_freq[0] ... inv_freq[D/2-1]`, then the
case's parameters as the test builds them (the test holds those; the names tie the two together). Transformers
computes in f32, the kernel in f64: the test allows a relative 1e-6.
"""

import transformers
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

CASES = [
    # name, head_dim, base, max_position_embeddings, rope_parameters, seq_len
    ("default", 64, 10000.0, 2048, {"rope_type": "default"}, None),
    ("linear", 64, 10000.0, 2048, {"rope_type": "linear", "factor": 4.0}, None),
    ("dynamic-long", 64, 10000.0, 2048, {"rope_type": "dynamic", "factor": 2.0}, 8192),
    ("dynamic-short", 64, 10000.0, 2048, {"rope_type": "dynamic", "factor": 2.0}, 1024),
    ("yarn", 64, 10000.0, 16384,
     {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}, None),
    ("yarn-mscale", 128, 500000.0, 16384,
     {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "mscale": 0.707,
      "mscale_all_dim": 0.5, "beta_fast": 16.0, "beta_slow": 2.0, "truncate": False}, None),
    ("longrope-long", 64, 10000.0, 16384,
     {"rope_type": "longrope", "original_max_position_embeddings": 4096,
      "short_factor": [1.0 + 0.01 * i for i in range(32)], "long_factor": [1.0 + 0.5 * i for i in range(32)]},
     8192),
    ("longrope-short", 64, 10000.0, 16384,
     {"rope_type": "longrope", "original_max_position_embeddings": 4096,
      "short_factor": [1.0 + 0.01 * i for i in range(32)], "long_factor": [1.0 + 0.5 * i for i in range(32)]},
     4096),
    ("longrope-attn", 64, 10000.0, 16384,
     {"rope_type": "longrope", "original_max_position_embeddings": 4096, "factor": 2.0, "attention_factor": 1.25,
      "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}, 8192),
    ("llama3", 128, 500000.0, 131072,
     {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, None),
]

print(f"# transformers {transformers.__version__}, torch {torch.__version__}")
for name, d, base, max_pos, rope, seq in CASES:
    cfg = LlamaConfig(hidden_size=d * 4, num_attention_heads=4, head_dim=d, max_position_embeddings=max_pos,
                      rope_parameters=dict(rope, rope_theta=base))
    if rope["rope_type"] == "default":
        inv, af = LlamaRotaryEmbedding.compute_default_rope_parameters(cfg)
    else:
        inv, af = ROPE_INIT_FUNCTIONS[rope["rope_type"]](cfg, "cpu", seq_len=seq)
    vals = " ".join(repr(float(x)) for x in inv.tolist())
    print(f"{name} {d} {base} {seq or 0} {float(af)!r} {vals}")
