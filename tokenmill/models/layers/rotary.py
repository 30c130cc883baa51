"""Rotary position embeddings with the rope scaling types HF implements.

Reads both config forms: transformers 5 `rope_parameters` and the older
`rope_theta` + `rope_scaling`.

LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini) has two sets of per-frequency factors: short
for sequences within the pretraining length, long beyond it. HF transformers switches
set by the current sequence length (recomputing the whole cache when a sequence crosses
over); a paged cache cannot, since cached keys would mix the two. So, as vLLM does, the
engine picks one set for its lifetime: long when max_model_len exceeds
original_max_position_embeddings, short otherwise (`longrope_choice`).
"""
from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope", "yarn")

# hf_config key (set by ModelConfig, not by checkpoints) carrying the engine's LongRoPE
# factor set: True for long_factor, False for short_factor.
LONGROPE_USE_LONG = "tokenmill_longrope_use_long"


def rope_parameters_from_config(cfg: dict) -> dict:
    """One flat dict with rope_type, rope_theta and the scaling fields."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and ("rope_type" in params or "type" in params
                                     or "rope_theta" in params):
        params = dict(params)
    else:
        params = dict(cfg.get("rope_scaling") or {})
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    params.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    if "partial_rotary_factor" in cfg:
        params.setdefault("partial_rotary_factor", cfg["partial_rotary_factor"])
    if params["rope_type"] == "su":  # Phi-3's first name for longrope
        params["rope_type"] = "longrope"
    if params["rope_type"] in ("yarn", "llama3", "longrope"):
        params.setdefault("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings")))
    if params["rope_type"] not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope_type {params['rope_type']!r} is not supported "
                         f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if params["rope_type"] == "longrope":
        for key in ("short_factor", "long_factor"):
            if not isinstance(params.get(key), list):
                raise ValueError(f"longrope rope scaling needs a list {key}, "
                                 f"got {params.get(key)!r}")
        params.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
        params["use_long_factor"] = bool(cfg.get(LONGROPE_USE_LONG, False))
    return params


def longrope_choice(cfg: dict, max_model_len: int) -> bool | None:
    """For a LongRoPE model: whether an engine of this max_model_len uses the long
    factors (None for any other rope type)."""
    params = cfg.get("rope_parameters")
    if not isinstance(params, dict) or not ("rope_type" in params or "type" in params):
        params = cfg.get("rope_scaling") or {}
    if params.get("rope_type", params.get("type")) not in ("longrope", "su"):
        return None
    original = params.get("original_max_position_embeddings",
                          cfg.get("original_max_position_embeddings",
                                  cfg.get("max_position_embeddings")))
    return max_model_len > int(original)


def cos_sin_table(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of fp32 `angles` (on a CPU: computed in fp64 by numpy, rounded once).

    Not `angles.cos()` on a CPU: torch hands fp32 sin / cos to MKL's vector math there,
    and the first such call in a process that has already run a GEMM is sometimes wrong
    on the first thread's share (an initialisation race inside the library): on a
    2-core Xeon with AMX ~10% of processes built a RoPE table off by up to 1.5e-4 (the
    cos of 4,000 rad), so logprobs differed from run to run by up to 2e-3. Rounding the
    fp64 value is within half an ulp of the exact result, as close to HF's fp32 table
    as its own (accurate) cos is."""
    if angles.device.type != "cpu":
        return angles.cos(), angles.sin()
    a = angles.detach().double().numpy()
    return (torch.from_numpy(np.cos(a)).to(angles.dtype),
            torch.from_numpy(np.sin(a)).to(angles.dtype))


def compute_inv_freq(params: dict, rotary_dim: int,
                     max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] and the cos/sin scale."""
    base = float(params["rope_theta"])
    dim = rotary_dim
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    rope_type = params["rope_type"]
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "longrope":
        orig_len = params["original_max_position_embeddings"]
        factor = params.get("factor")
        if factor is None:  # Phi-3 stores the extension as the ratio of the two lengths
            factor = (params.get("max_position_embeddings") or max_position_embeddings) / orig_len
        attn_factor = params.get("attention_factor")
        if attn_factor is None:
            attn_factor = 1.0 if factor <= 1.0 else \
                math.sqrt(1 + math.log(factor) / math.log(orig_len))
        ext = torch.tensor(params["long_factor" if params["use_long_factor"] else "short_factor"],
                           dtype=torch.float32)
        if ext.numel() != dim // 2:
            raise ValueError(f"longrope factors have {ext.numel()} entries; the rotary "
                             f"dimension {dim} needs {dim // 2}")
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (ext * base ** exponents), float(attn_factor)
    if rope_type == "llama3":
        factor = params["factor"]
        low_ff, high_ff = params["low_freq_factor"], params["high_freq_factor"]
        old_len = params["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low_ff, old_len / high_ff
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled), 1.0
    # yarn
    orig_len = params["original_max_position_embeddings"]
    factor = params.get("factor")
    if factor is None:
        factor = max_position_embeddings / orig_len

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = params.get("attention_factor")
    if attn_factor is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attn_factor = float(mscale(factor, m) / mscale(factor, m_all)) if m and m_all \
            else mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(orig_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, attn_factor


class RotaryEmbedding(nn.Module):
    """Neox-style rotary over the first `rotary_dim` features of each head."""

    def __init__(self, head_dim: int, rotary_dim: int, max_position: int, params: dict):
        super().__init__()
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        inv_freq, scale = compute_inv_freq(params, rotary_dim, max_position)
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = cos_sin_table(torch.cat([freqs, freqs], dim=-1))
        self.register_buffer("cos_cache", cos * scale, persistent=False)
        self.register_buffer("sin_cache", sin * scale, persistent=False)
        self._tables: dict = {}  # (dtype, device) -> [2, max_position, 1, rotary_dim]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """Per-token cos/sin [T, 1, rotary_dim], computed once per step for every layer."""
        table = self.table(dtype)
        if positions.dim() == 1:  # (index_select: a fraction of advanced indexing's cost)
            return table.index_select(1, positions).unbind(0)
        cos_sin = table[:, positions]
        return cos_sin[0], cos_sin[1]

    def table(self, dtype: torch.dtype) -> torch.Tensor:
        """cos and sin in `dtype`, side by side [2, max_position, 1, rotary_dim]: one
        gather per step."""
        key = (dtype, self.cos_cache.device)
        table = self._tables.get(key)
        if table is None:
            table = torch.stack([self.cos_cache, self.sin_cache]).to(dtype).unsqueeze(2)
            self._tables = {key: table}
        return table

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, head_dim] -> rotated copy."""
        rd = self.rotary_dim
        if rd == self.head_dim:
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin
        xr, xp = x[..., :rd], x[..., rd:]
        x1, x2 = xr.chunk(2, dim=-1)
        return torch.cat([xr * cos + torch.cat([-x2, x1], dim=-1) * sin, xp], dim=-1)
