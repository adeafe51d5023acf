"""Writes a tiny Llama (2 layers, 2 KV heads, head dim 64) with seeded random weights, so the
real-engine tests run a real model without downloading one. Usage: make_model.py DIR"""

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN, VOCAB = 128, 2, 2, 2, 256, 1000


def main(out: Path) -> None:
    head_dim = HIDDEN // HEADS
    g = torch.Generator().manual_seed(1234)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.05

    tensors = {"model.embed_tokens.weight": w(VOCAB, HIDDEN), "lm_head.weight": w(VOCAB, HIDDEN)}
    tensors["model.norm.weight"] = torch.ones(HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(HEADS * head_dim, HIDDEN),
            p + "self_attn.k_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.v_proj.weight": w(KV_HEADS * head_dim, HIDDEN),
            p + "self_attn.o_proj.weight": w(HIDDEN, HEADS * head_dim),
            p + "mlp.gate_proj.weight": w(FFN, HIDDEN),
            p + "mlp.up_proj.weight": w(FFN, HIDDEN),
            p + "mlp.down_proj.weight": w(HIDDEN, FFN),
            p + "input_layernorm.weight": torch.ones(HIDDEN),
            p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
        }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": FFN,
        "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS,
        "num_hidden_layers": LAYERS,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float32",
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
