"""Random-weight draft checkpoints for a given target, in the layouts published
drafters use: EAGLE-3 folders, Qwen3-DFlash folders and an MTP head (mtp.*) added to
a Qwen3.5 / Qwen3-Next checkpoint. The tests build tiny ones; `bench spec` builds
them for the benchmark models to measure what a step of rejected drafts costs.

Weights are seeded fp32 with a large scale (std 0.2, norms 1 +- 0.2) so the draft
logits are far from flat and a weight that is skipped or swapped shows.
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file


def _sizes_and_draws(target_config: dict, seed: int):
    """(hidden, heads, kv heads, head_dim, intermediate, vocab) of the target, and the
    seeded draws of a random matrix and of a norm weight."""
    h = target_config["hidden_size"]
    heads = target_config["num_attention_heads"]
    kv_heads = target_config.get("num_key_value_heads") or heads
    d = target_config.get("head_dim") or h // heads
    g = torch.Generator().manual_seed(seed)

    def mat(*shape):
        return 0.2 * torch.randn(*shape, generator=g)

    def norm(n):
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    sizes = (h, heads, kv_heads, d, target_config["intermediate_size"],
             target_config["vocab_size"])
    return sizes, mat, norm, g


def eagle3_tensors(target_config: dict, *, draft_vocab_size: int = 96, num_aux: int = 3,
                   with_embedding: bool = True, seed: int = 0) -> dict[str, torch.Tensor]:
    """The drafter's tensors under their checkpoint names (no prefix), for a draft with the
    target's hidden size, heads, head_dim and intermediate size."""
    (h, heads, kv_heads, d, inter, vocab), mat, norm, g = _sizes_and_draws(target_config, seed)
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
                            prefix: str = "", layer_prefix: str = "midlayer.") -> str:
    """Write config.json and model.safetensors (every name under `prefix`, e.g. "model.";
    the decoder layer's under `layer_prefix`: "midlayer." as the EAGLE repository
    publishes heads, "layers.0." as other exports do)."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)

    def name(k: str) -> str:
        return prefix + (layer_prefix + k[len("midlayer."):] if k.startswith("midlayer.") else k)
    save_file({name(k): v.contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"))
    return path


def build_eagle3_checkpoint(path: str, target_config: dict, *, draft_vocab_size: int = 96,
                            with_embedding: bool = True, prefix: str = "", seed: int = 0,
                            layer_prefix: str = "midlayer.",
                            **config_overrides) -> tuple[dict, dict[str, torch.Tensor]]:
    """Write a drafter folder for the target of `target_config`; -> (config, tensors
    named as the module names them)."""
    ids = (config_overrides.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    tensors = eagle3_tensors(target_config, draft_vocab_size=draft_vocab_size,
                             num_aux=len(ids) if ids else 3, with_embedding=with_embedding,
                             seed=seed)
    config = eagle3_config(target_config, draft_vocab_size=draft_vocab_size, **config_overrides)
    write_eagle3_checkpoint(path, config, tensors, prefix, layer_prefix)
    return config, tensors


# ---- DFlash (Qwen3-DFlash layout, as z-lab publishes) -----------------------------
def build_dflash_checkpoint(path: str, target_config: dict, *, num_layers: int = 2,
                            target_layer_ids=(0, 1), mask_token_id: int | None = None,
                            block_size: int = 8, seed: int = 0, config_overrides=None,
                            dflash_overrides=None, own_embed: bool = False,
                            drop=()) -> dict[str, torch.Tensor]:
    """Save a tiny Qwen3-DFlash draft for a target whose HF config is `target_config`:
    config.json (the target's sizes, `num_layers` layers, `dflash_config`) and
    model.safetensors in z-lab's layout (no "model." prefix, no lm_head: the target's
    is shared; embed_tokens only with `own_embed`). Random weights with std 0.2 (norms
    1 + 0.2 randn) so the logits are not flat; `drop` leaves tensors out. Returns the
    tensors written."""
    (h, nh, nkv, d, inter, vocab), w, norm, _ = _sizes_and_draws(target_config, seed)
    t = {"fc.weight": w(h, len(target_layer_ids) * h), "hidden_norm.weight": norm(h),
         "norm.weight": norm(h)}
    if own_embed:
        t["embed_tokens.weight"] = w(vocab, h)
    for i in range(num_layers):
        p = f"layers.{i}."
        t.update({p + "input_layernorm.weight": norm(h),
                  p + "post_attention_layernorm.weight": norm(h),
                  p + "self_attn.q_proj.weight": w(nh * d, h),
                  p + "self_attn.k_proj.weight": w(nkv * d, h),
                  p + "self_attn.v_proj.weight": w(nkv * d, h),
                  p + "self_attn.o_proj.weight": w(h, nh * d),
                  p + "self_attn.q_norm.weight": norm(d),
                  p + "self_attn.k_norm.weight": norm(d),
                  p + "mlp.gate_proj.weight": w(inter, h),
                  p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter)})
    for name in drop:
        del t[name]
    config = {k: target_config[k] for k in (
        "vocab_size", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "max_position_embeddings", "rms_norm_eps")}
    config.update(architectures=["DFlashDraftModel"], model_type="qwen3", head_dim=d,
                  num_hidden_layers=num_layers, hidden_act="silu", rope_theta=10000.0,
                  dflash_config=dict(target_layer_ids=list(target_layer_ids),
                                     mask_token_id=vocab - 1 if mask_token_id is None
                                     else mask_token_id, block_size=block_size))
    config["dflash_config"].update(dflash_overrides or {})
    config.update(config_overrides or {})
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({k: v.contiguous() for k, v in t.items()}, os.path.join(path, "model.safetensors"))
    return t


# ---- an MTP head (mtp.*) for a Qwen3.5 / Qwen3-Next checkpoint ---------------------
def mtp_tensors(path: str, seed: int) -> dict[str, torch.Tensor]:
    """Random MTP tensors: layers.0 copies the names and shapes of the target's last
    full-attention layer. Norm weights are zero-centred (the model scales by 1 + w)."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    full = max(i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention")
    src = f"model.layers.{full}."
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        shapes = {n[len(src):]: f.get_slice(n).get_shape() for n in f.keys()
                  if n.startswith(src)}
    h = cfg["hidden_size"]
    shapes = {**{f"layers.0.{n}": s for n, s in shapes.items()}, "fc.weight": [h, 2 * h],
              "pre_fc_norm_embedding.weight": [h], "pre_fc_norm_hidden.weight": [h],
              "norm.weight": [h]}
    g = torch.Generator().manual_seed(seed)
    return {f"mtp.{n}": 0.2 * torch.randn(s, generator=g) for n, s in sorted(shapes.items())}


def write_folder(path: str, base: str, config: dict, mtp: dict[str, torch.Tensor] | None):
    """A checkpoint folder: the base model's weights (linked), `config`, and `mtp` as an
    extra shard named in model.safetensors.index.json."""
    os.makedirs(path, exist_ok=True)
    os.symlink(os.path.join(base, "model.safetensors"), os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    if mtp is None:
        return
    save_file(mtp, os.path.join(path, "mtp.safetensors"))
    with safe_open(os.path.join(base, "model.safetensors"), framework="pt") as f:
        weight_map = {n: "model.safetensors" for n in f.keys()}
    weight_map.update({n: "mtp.safetensors" for n in mtp})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


# ---- DeepSeek-V3's MTP block (model.layers.{N}.*) ------------------------------------
def deepseek_mtp_tensors(path: str, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors of a V3 MTP block: its decoder layer copies the names and shapes of
    the target's last layer (sparse as that one is: check the config makes layer N so
    too); enorm / hnorm / shared_head.norm near 1 (plain RMSNorms), eh_proj [H, 2H],
    shared_head.head [V, H] and the block's embedding copy [V, H]."""
    cfg = json.load(open(os.path.join(path, "config.json")))
    n, h, vocab = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    src = f"model.layers.{n - 1}."
    with safe_open(os.path.join(path, "model.safetensors"), framework="pt") as f:
        shapes = {n2[len(src):]: f.get_slice(n2).get_shape() for n2 in f.keys()
                  if n2.startswith(src)}
    g = torch.Generator().manual_seed(seed)
    t = {k: (1.0 if k.endswith("norm.weight") else 0.0) + 0.2 * torch.randn(s, generator=g)
         for k, s in sorted(shapes.items())}
    t.update({"enorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
              "hnorm.weight": 1 + 0.2 * torch.randn(h, generator=g),
              "eh_proj.weight": 0.2 * torch.randn(h, 2 * h, generator=g),
              "shared_head.norm.weight": 1 + 0.2 * torch.randn(h, generator=g),
              "shared_head.head.weight": 0.2 * torch.randn(vocab, h, generator=g),
              "embed_tokens.weight": 0.2 * torch.randn(vocab, h, generator=g)})
    return {f"model.layers.{n}.{k}": v for k, v in t.items()}
