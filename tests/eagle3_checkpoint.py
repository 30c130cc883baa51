"""A tiny random EAGLE-3 drafter folder for a tiny target (tests only; no network).

Laid out as the published Llama-3.1 drafters are: config.json with `draft_vocab_size`
and model.safetensors with fc / midlayer.* / norm / lm_head / d2t / t2d, embed_tokens
optional. Weights are seeded fp32 with a large scale (std 0.2, norms 1 +- 0.2) so the
draft logits are far from flat and a weight that is skipped or swapped shows.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def eagle3_tensors(target_config: dict, *, draft_vocab_size: int = 96, num_aux: int = 3,
                   with_embedding: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """The drafter's tensors under their checkpoint names (no prefix), for a draft with the
    target's hidden size, heads, head_dim and intermediate size."""
    h = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    kv_heads = target_config.get("num_key_value_heads") or heads
    d = target_config.get("head_dim") or h // heads
    inter, vocab = target_config["intermediate_size"], target_config["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return 0.2 * torch.randn(*shape, generator=g)

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    t = {"fc.weight": mat(h, num_aux * h)}
    if with_embedding:
        t["embed_tokens.weight"] = mat(vocab, h)
    m = "midlayer."
    t[m + "input_layernorm.weight"] = norm(h)
    t[m + "hidden_norm.weight"] = norm(h)
    t[m + "self_attn.q_proj.weight"] = mat(heads * d, 2 * h)
    t[m + "self_attn.k_proj.weight"] = mat(kv_heads * d, 2 * h)
    t[m + "self_attn.v_proj.weight"] = mat(kv_heads * d, 2 * h)
    t[m + "self_attn.o_proj.weight"] = mat(h, heads * d)
    t[m + "post_attention_layernorm.weight"] = norm(h)
    t[m + "mlp.gate_proj.weight"] = mat(inter, h)
    t[m + "mlp.up_proj.weight"] = mat(inter, h)
    t[m + "mlp.down_proj.weight"] = mat(h, inter)
    t["norm.weight"] = norm(h)
    t["lm_head.weight"] = mat(draft_vocab_size, h)
    # The draft vocabulary: a random sorted subset of the target's, as d2t offsets.
    target_ids = torch.randperm(vocab, generator=g)[:draft_vocab_size].sort().values
    t["d2t"] = target_ids - torch.arange(draft_vocab_size)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[target_ids] = True
    t["t2d"] = t2d
    return t


def eagle3_config(target_config: dict, *, draft_vocab_size: int = 96, **overrides) -> dict:
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": target_config["hidden_size"],
        "intermediate_size": target_config["intermediate_size"],
        "num_attention_heads": target_config["num_attention_heads"],
        "num_key_value_heads": target_config.get("num_key_value_heads"),
        "head_dim": target_config.get("head_dim"),
        "num_hidden_layers": 1, "rms_norm_eps": 1e-6, "hidden_act": "silu",
        # Not the target's theta: the drafter's rope comes from its own config.
        "rope_theta": 5000.0, "max_position_embeddings": 64,
        "vocab_size": target_config["vocab_size"], "draft_vocab_size": draft_vocab_size,
        "tie_word_embeddings": False, "torch_dtype": "float32",
    }
    cfg.update(overrides)
    return cfg


def write_eagle3_checkpoint(path: str, config: dict, tensors: dict[str, torch.Tensor],
                            prefix: str = "") -> str:
    """Write config.json and model.safetensors (every name under `prefix`, e.g. "model.")."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({prefix + k: v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def build_eagle3_checkpoint(path: str, target_config: dict, *, draft_vocab_size: int = 96,
                            with_embedding: bool = True, prefix: str = "", seed: int = 0,
                            **config_overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """Write a drafter folder for the target of `target_config`; -> (config, tensors)."""
    ids = (config_overrides.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    tensors = eagle3_tensors(target_config, draft_vocab_size=draft_vocab_size,
                             num_aux=len(ids) if ids else 3, with_embedding=with_embedding,
                             seed=seed)
    config = eagle3_config(target_config, draft_vocab_size=draft_vocab_size, **config_overrides)
    write_eagle3_checkpoint(path, config, tensors, prefix)
    return config, tensors
