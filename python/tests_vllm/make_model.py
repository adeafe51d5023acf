"""Writes a small model with seeded random weights, so the real-engine tests and the benchmark
run a real model without downloading one. Usage: make_model.py DIR [--preset NAME]

Presets: `tiny` (2 layers, 2 KV heads, head dim 64, fp32: 2 KiB of KV per token), `tiny-kv1`
(`tiny` with one KV head: another KV layout, for refusals),
`hybrid` (4 layers alternating full and 64-token sliding-window attention, as Gemma 3 and
gpt-oss interleave them: vLLM's hybrid KV cache manager gives the two kinds separate KV cache
groups that share memory), `mla` (a DeepSeek-V2: 2 dense layers with multi-head latent
attention, a 512-wide latent and 64 rotary dims, the sizes vLLM's CPU MLA kernel runs: one
576-element latent cache entry per token and layer, fp32), `mamba2` (2 Mamba2 layers, 8 heads
of 32 with a 16-wide state and a 4-tap convolution: one 19,840-byte state page per request
and layer, fp32, no KV cache), `nemotron-h` (a Nemotron-H: Mamba2, attention, Mamba2,
attention, the Mamba layers as `mamba2`'s and the attention as `tiny`'s: two KV cache groups
sharing memory, each state page padded to the attention block), and `llama8b-kv`: Llama-3-8B's
KV geometry (32 layers, 8 KV heads, head dim 128, bf16: 128 KiB of KV per token, as the real
model) with a hidden size of 256 and 8 query heads, so a CPU prefill costs seconds instead of
minutes; the query heads do not change the KV cache.
"""

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "torch_dtype": "float32",
    },
    "tiny-kv1": {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "torch_dtype": "float32",
    },
    "hybrid": {
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "num_hidden_layers": 4,
        "intermediate_size": 256,
        "torch_dtype": "float32",
        "layer_types": ["full_attention", "sliding_attention"] * 2,
        "sliding_window": 64,
    },
    "mla": {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": 128,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "torch_dtype": "float32",
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 32,
        "v_head_dim": 32,
        # Every layer dense (the first 2): no experts are made.
        "first_k_dense_replace": 2,
        "n_routed_experts": 4,
        "n_shared_experts": 1,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
    },
    "mamba2": {
        "architectures": ["Mamba2ForCausalLM"],
        "model_type": "mamba2",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "state_size": 16,
        "expand": 2,
        "head_dim": 32,
        "num_heads": 8,
        "n_groups": 1,
        "conv_kernel": 4,
        "chunk_size": 256,
        "use_bias": False,
        "use_conv_bias": True,
        "rms_norm": True,
        "residual_in_fp32": True,
        "time_step_rank": 8,
        "layer_norm_epsilon": 1e-5,
        "torch_dtype": "float32",
    },
    "nemotron-h": {
        "architectures": ["NemotronHForCausalLM"],
        "model_type": "nemotron_h",
        "hidden_size": 128,
        # Mamba, attention, Mamba, attention: two KV cache groups sharing memory.
        "hybrid_override_pattern": "M*M*",
        "num_hidden_layers": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 2,
        "head_dim": 64,
        "intermediate_size": 256,
        "mamba_num_heads": 8,
        "mamba_head_dim": 32,
        "ssm_state_size": 16,
        "n_groups": 1,
        "conv_kernel": 4,
        "expand": 2,
        "chunk_size": 256,
        "mamba_hidden_act": "silu",
        "mlp_hidden_act": "relu2",
        "use_bias": False,
        "use_conv_bias": True,
        "attention_bias": False,
        "mlp_bias": False,
        "residual_in_fp32": False,
        "layer_norm_epsilon": 1e-5,
        "rms_norm_eps": 1e-5,
        "time_step_limit": [0.0, 1e9],
        "time_step_min": 0.001,
        "time_step_max": 0.1,
        "time_step_floor": 1e-4,
        "mamba_proj_bias": False,
        "rescale_prenorm_residual": True,
        "torch_dtype": "float32",
    },
    "llama8b-kv": {
        "hidden_size": 256,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "num_hidden_layers": 32,
        "intermediate_size": 512,
        "torch_dtype": "bfloat16",
    },
}
VOCAB = 1000


Draw = Callable[..., torch.Tensor]


def seeded() -> Draw:
    """Seeded normal weights of a shape, scaled (0.05 unless `scale`)."""
    g = torch.Generator().manual_seed(1234)

    def w(*shape: int, scale: float = 0.05) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * scale

    return w


def mamba_mixer(
    w: Draw, prefix: str, hidden: int, inner: int, heads: int, state: int, groups: int, kernel: int
) -> dict[str, torch.Tensor]:
    """A Mamba2 mixer's weights (HF names under `prefix`): decay rates A that span fast to
    slow (so the state carries the prompt), the skip D at 1."""
    conv = inner + 2 * groups * state
    return {
        prefix + "in_proj.weight": w(2 * inner + 2 * groups * state + heads, hidden),
        prefix + "conv1d.weight": w(conv, 1, kernel, scale=0.3),
        prefix + "conv1d.bias": w(conv),
        prefix + "dt_bias": w(heads),
        prefix + "A_log": torch.log(torch.linspace(1.0, 16.0, heads)),
        prefix + "D": torch.ones(heads),
        prefix + "norm.weight": torch.ones(inner),
        prefix + "out_proj.weight": w(hidden, inner),
    }


def save_backbone_model(out: Path, c: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Writes a `backbone.`-named model (Mamba2, Nemotron-H) and its config."""
    config = {
        **c,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


def backbone(w: Draw, hidden: int) -> dict[str, torch.Tensor]:
    """The embeddings, final norm and LM head of a `backbone.`-named model."""
    return {
        "backbone.embeddings.weight": w(VOCAB, hidden, scale=1.0),
        "backbone.norm_f.weight": torch.ones(hidden),
        "lm_head.weight": w(VOCAB, hidden),
    }


def mamba2(out: Path, c: dict[str, Any]) -> None:
    """A Mamba2 model (HF's `Mamba2ForCausalLM` names), seeded weights."""
    hidden, layers = int(c["hidden_size"]), int(c["num_hidden_layers"])
    inner, heads = int(c["expand"]) * hidden, int(c["num_heads"])
    state, groups, kernel = int(c["state_size"]), int(c["n_groups"]), int(c["conv_kernel"])
    w = seeded()
    tensors = backbone(w, hidden)
    for i in range(layers):
        tensors[f"backbone.layers.{i}.norm.weight"] = torch.ones(hidden)
        tensors |= mamba_mixer(
            w, f"backbone.layers.{i}.mixer.", hidden, inner, heads, state, groups, kernel
        )
    save_backbone_model(out, c, tensors)


def nemotron_h(out: Path, c: dict[str, Any]) -> None:
    """A Nemotron-H (HF's `NemotronHForCausalLM` names): Mamba2 mixers (`M`) and attention
    mixers (`*`) as `hybrid_override_pattern` orders them, seeded weights."""
    hidden, heads, kv_heads = (
        int(c["hidden_size"]),
        int(c["num_attention_heads"]),
        int(c["num_key_value_heads"]),
    )
    head_dim, m_heads = int(c["head_dim"]), int(c["mamba_num_heads"])
    inner = m_heads * int(c["mamba_head_dim"])
    state, groups, kernel = int(c["ssm_state_size"]), int(c["n_groups"]), int(c["conv_kernel"])
    w = seeded()
    tensors = backbone(w, hidden)
    for i, kind in enumerate(str(c["hybrid_override_pattern"])):
        m = f"backbone.layers.{i}.mixer."
        tensors[f"backbone.layers.{i}.norm.weight"] = torch.ones(hidden)
        if kind == "M":
            tensors |= mamba_mixer(w, m, hidden, inner, m_heads, state, groups, kernel)
        else:
            tensors |= {
                m + "q_proj.weight": w(heads * head_dim, hidden),
                m + "k_proj.weight": w(kv_heads * head_dim, hidden),
                m + "v_proj.weight": w(kv_heads * head_dim, hidden),
                m + "o_proj.weight": w(hidden, heads * head_dim),
            }
    save_backbone_model(out, c, tensors)


def main(out: Path, preset: str) -> None:
    c = PRESETS[preset]
    if c.get("model_type") == "mamba2":
        mamba2(out, c)
        return
    if c.get("model_type") == "nemotron_h":
        nemotron_h(out, c)
        return
    hidden, heads, kv_heads = (
        int(c["hidden_size"]),
        int(c["num_attention_heads"]),
        int(c["num_key_value_heads"]),
    )
    layers, ffn = int(c["num_hidden_layers"]), int(c["intermediate_size"])
    dtype = getattr(torch, str(c["torch_dtype"]))
    g = torch.Generator().manual_seed(1234)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=g) * 0.05).to(dtype)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors = {"model.embed_tokens.weight": w(VOCAB, hidden), "lm_head.weight": w(VOCAB, hidden)}
    tensors["model.norm.weight"] = ones(hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if "kv_lora_rank" in c:  # MLA: keys and values come out of one latent per token
            rank, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
            nope, v = int(c["qk_nope_head_dim"]), int(c["v_head_dim"])
            tensors |= {
                a + "q_proj.weight": w(heads * (nope + rope), hidden),
                a + "kv_a_proj_with_mqa.weight": w(rank + rope, hidden),
                a + "kv_a_layernorm.weight": ones(rank),
                a + "kv_b_proj.weight": w(heads * (nope + v), rank),
                a + "o_proj.weight": w(hidden, heads * v),
            }
        else:
            head_dim = int(c["head_dim"])
            tensors |= {
                a + "q_proj.weight": w(heads * head_dim, hidden),
                a + "k_proj.weight": w(kv_heads * head_dim, hidden),
                a + "v_proj.weight": w(kv_heads * head_dim, hidden),
                a + "o_proj.weight": w(hidden, heads * head_dim),
            }
        tensors |= {
            p + "mlp.gate_proj.weight": w(ffn, hidden),
            p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
            p + "input_layernorm.weight": ones(hidden),
            p + "post_attention_layernorm.weight": ones(hidden),
        }
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **c,
        "vocab_size": VOCAB,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(config, indent=1))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    a = ap.parse_args()
    main(a.dir, a.preset)
