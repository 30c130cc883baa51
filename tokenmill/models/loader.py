"""Build a model and fill it from a Hugging Face folder of safetensors."""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.models.layers.linear import widen_gemms
from tokenmill.models.registry import resolve_model_class

logger = logging.getLogger(__name__)


def safetensors_files(model_dir: str) -> list[str]:
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(model_dir, name) for name in sorted(set(weight_map.values()))]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(model_dir) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {model_dir}")
    return [os.path.join(model_dir, f) for f in found]


def iter_checkpoint(model_dir: str):
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _param_name(ckpt_name: str, packed: dict) -> tuple[str, int | None]:
    """HF name -> (our parameter name, shard index inside a packed parameter)."""
    name = ckpt_name
    if name.startswith("model."):
        name = name[len("model."):]
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            target, shard = packed[part]
            parts[i] = target
            return ".".join(parts), shard
    return name, None


def load_weights(model: nn.Module, model_dir: str) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    # Shards of a packed parameter wait here until all of them arrived.
    pending: dict[str, dict[int, torch.Tensor]] = {}
    num_shards = {}
    for _, (target, _) in packed.items():
        num_shards[target] = num_shards.get(target, 0) + 1
    loaded = set()
    for ckpt_name, tensor in iter_checkpoint(model_dir):
        if "rotary_emb.inv_freq" in ckpt_name:
            continue
        name, shard = _param_name(ckpt_name, packed)
        if name not in params:
            logger.warning("skipping checkpoint tensor %s (no matching parameter)", ckpt_name)
            continue
        if shard is None:
            _copy(params[name], tensor, ckpt_name)
            loaded.add(name)
            continue
        parts = pending.setdefault(name, {})
        parts[shard] = tensor
        target_short = name.rsplit(".", 2)[-2]
        if len(parts) == num_shards[target_short]:
            _copy(params[name], torch.cat([parts[i] for i in range(len(parts))], dim=0), name)
            loaded.add(name)
            del pending[name]
    if pending:
        raise ValueError(f"incomplete packed weights in checkpoint: {sorted(pending)}")
    missing = [n for n in params if n not in loaded]
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if "lm_head.weight" in missing and tied:
        missing.remove("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))


def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != "
                         f"model shape {tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)


def load_model(model_dir: str, hf_config: dict, dtype: torch.dtype,
               device: torch.device, gemm_dtype: torch.dtype | None = None) -> nn.Module:
    """Build and fill the model; `gemm_dtype` widens its Linear layers (see layers/linear.py)."""
    cls = resolve_model_class(hf_config)
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(hf_config)
    finally:
        torch.set_default_dtype(torch_default)
    load_weights(model, model_dir)
    if gemm_dtype is not None and gemm_dtype != dtype:
        n = widen_gemms(model, gemm_dtype)
        logger.info("%d linear layers compute in %s (activations and KV cache stay %s)",
                    n, gemm_dtype, dtype)
    # Rotary tables stay fp32 (computed as HF computes them); everything else in dtype.
    return model.eval().requires_grad_(False)
