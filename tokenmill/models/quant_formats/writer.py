"""Quantize an unquantized Hugging Face checkpoint folder into GPTQ, AWQ or
compressed-tensors' exact published layout (round-to-nearest, rtn.py; compressed-
tensors' FP8 block strategy too: encode.quantize_fp8_block), and optionally
write the dequantized fp32 checkpoint that HF transformers runs as the reference.

Quantized: every 2-D `*_proj.weight` of the decoder layers (attention and MLP
projections, MoE experts per expert; not the router or the embeddings), and the
lm_head only where asked (GPTQ's `lm_head: true`), except the modules named in `keep`. The files keep the source's sharding (one output
file per source file, the index rewritten); config.json gets the format's
quantization_config.
"""
from __future__ import annotations

import json
import os
import shutil
import zlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tokenmill.models.checkpoint_io import safetensors_files
from tokenmill.models.quant_formats.encode import (encode_awq, encode_compressed_tensors,
                                                   encode_compressed_tensors_fp8_block,
                                                   encode_gptq, quantize_fp8_block)
from tokenmill.models.quant_formats.rtn import quantize_rtn

INDEX = "model.safetensors.index.json"


def quantizable(name: str, t: torch.Tensor, lm_head: bool = False) -> bool:
    if lm_head and name == "lm_head.weight":
        return t.dim() == 2
    return t.dim() == 2 and name.endswith("_proj.weight") and ".layers." in name


def act_order_perm_for(name: str, k: int, seed: int = 0) -> torch.Tensor:
    """A shuffled column order for act-order, the same for every matrix reading the
    same input (q / k / v, gate / up, as GPTQ's shared Hessian gives them)."""
    parent = name.rsplit(".", 2)[0]  # "model.layers.0.self_attn", "...experts.3"
    g = torch.Generator().manual_seed(zlib.crc32(f"{parent}:{k}:{seed}".encode()))
    return torch.randperm(k, generator=g)


def _copy_side_files(src: str, dst: str) -> None:
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(".safetensors") and name != INDEX:
            shutil.copy(path, dst)


def _write_config(src: str, dst: str, qc: dict | None) -> None:
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    if qc is not None:
        cfg["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def write_quantized(src_dir: str, dst_dir: str, encode, qc: dict,
                    reference_dir: str | None = None, keep: tuple[str, ...] = (),
                    return_dequantized: bool = True,
                    lm_head: bool = False) -> dict[str, torch.Tensor]:
    """`src_dir` rewritten into `dst_dir` with every quantizable weight replaced by
    encode(name, w) -> (tensors by kind, its QuantizedWeight); `reference_dir`: also
    the same checkpoint with those weights dequantized (fp32). Returns the dequantized
    weights by checkpoint name (empty unless `return_dequantized`: a large model's
    would not fit in memory). `lm_head`: quantize the (untied) lm_head too."""
    _copy_side_files(src_dir, dst_dir)
    _write_config(src_dir, dst_dir, qc)
    if reference_dir is not None:
        _copy_side_files(src_dir, reference_dir)
        _write_config(src_dir, reference_dir, None)
    deq_all: dict[str, torch.Tensor] = {}
    weight_map: dict[str, str] = {}
    for path in safetensors_files(src_dir):
        fname = os.path.basename(path)
        out, ref = {}, {}
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                t = f.get_tensor(name)
                if not quantizable(name, t, lm_head) or any(name.startswith(m + ".") for m in keep):
                    out[name] = t
                    if reference_dir is not None:
                        ref[name] = t
                    continue
                tensors, qw = encode(name, t)
                prefix = name[:-len(".weight")]
                out.update({f"{prefix}.{kind}": v for kind, v in tensors.items()})
                if reference_dir is not None or return_dequantized:
                    deq = qw.dequantize()  # fp32, as HF's reference runs it
                    if reference_dir is not None:
                        ref[name] = deq
                    if return_dequantized:
                        deq_all[name] = deq
        save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(dst_dir, fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in out})
        if reference_dir is not None:
            save_file({k: v.contiguous() for k, v in ref.items()},
                      os.path.join(reference_dir, fname), metadata={"format": "pt"})
    if os.path.exists(os.path.join(src_dir, INDEX)):
        with open(os.path.join(dst_dir, INDEX), "w") as f:
            json.dump({"metadata": {}, "weight_map": weight_map}, f, indent=2)
        if reference_dir is not None:
            shutil.copy(os.path.join(src_dir, INDEX), reference_dir)
    return deq_all


def write_gptq_checkpoint(src_dir: str, dst_dir: str, bits: int = 4, group_size: int = 128,
                          sym: bool = True, desc_act: bool = False,
                          checkpoint_format: str = "gptq", reference_dir: str | None = None,
                          keep: tuple[str, ...] = (), seed: int = 0,
                          return_dequantized: bool = True,
                          lm_head: bool = False) -> dict[str, torch.Tensor]:
    """GPTQ (AutoGPTQ "gptq" v1 zeros, or GPTQModel "gptq_v2"): qweight / qzeros /
    scales (fp16) / g_idx; desc_act shuffles each matrix's columns into act-order;
    `lm_head`: the lm_head quantized too (config `lm_head: true`)."""
    v1 = checkpoint_format == "gptq"

    def encode(name, w):
        perm = act_order_perm_for(name, w.shape[1], seed) if desc_act else None
        qw = quantize_rtn(w, bits, group_size, sym, perm, torch.float16,
                          min_zero=1 if v1 and not sym else 0)
        return encode_gptq(qw, v1), qw

    qc = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
          "desc_act": desc_act, "sym": sym, "checkpoint_format": checkpoint_format,
          "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
          "lm_head": lm_head}
    return write_quantized(src_dir, dst_dir, encode, qc, reference_dir, keep,
                           return_dequantized, lm_head)


def write_awq_checkpoint(src_dir: str, dst_dir: str, group_size: int = 128,
                         reference_dir: str | None = None, keep: tuple[str, ...] = (),
                         return_dequantized: bool = True) -> dict[str, torch.Tensor]:
    """AWQ GEMM layout (AutoAWQ): 4-bit, zero points, fp16 scales."""
    def encode(name, w):
        qw = quantize_rtn(w, 4, group_size, False, None, torch.float16)
        return encode_awq(qw), qw

    qc = {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
          "version": "gemm", "modules_to_not_convert": [m.removeprefix("model.")
                                                         for m in keep] or None}
    return write_quantized(src_dir, dst_dir, encode, qc, reference_dir, keep,
                           return_dequantized)


def write_compressed_tensors_checkpoint(src_dir: str, dst_dir: str, bits: int = 4,
                                        group_size: int | None = 128, symmetric: bool = True,
                                        actorder: bool = False,
                                        scale_dtype: torch.dtype = torch.bfloat16,
                                        reference_dir: str | None = None,
                                        keep: tuple[str, ...] = (), seed: int = 0,
                                        return_dequantized: bool = True
                                        ) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized (llm-compressor W4A16 / W8A16): group_size None
    is strategy "channel"; actorder stores weight_g_idx."""
    def encode(name, w):
        perm = act_order_perm_for(name, w.shape[1], seed) if actorder else None
        qw = quantize_rtn(w, bits, -1 if group_size is None else group_size, symmetric,
                          perm, scale_dtype)
        return encode_compressed_tensors(qw, symmetric, scale_dtype), qw

    weights = {"num_bits": bits, "type": "int", "symmetric": symmetric,
               "strategy": "channel" if group_size is None else "group",
               "group_size": group_size, "dynamic": False,
               "actorder": "group" if actorder else None, "observer": "minmax"}
    qc = {"quant_method": "compressed-tensors", "format": "pack-quantized",
          "quantization_status": "compressed", "kv_cache_scheme": None,
          "sparsity_config": {},
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": None,
                                        "output_activations": None,
                                        "format": "pack-quantized"}},
          "ignore": ["lm_head", *keep]}
    return write_quantized(src_dir, dst_dir, encode, qc, reference_dir, keep,
                           return_dequantized)


def write_compressed_tensors_fp8_block_checkpoint(
        src_dir: str, dst_dir: str, block: tuple[int, int] = (128, 128),
        reference_dir: str | None = None, keep: tuple[str, ...] = (),
        return_dequantized: bool = True) -> dict[str, torch.Tensor]:
    """compressed-tensors float-quantized FP8 with block scales (llm-compressor's
    FP8_BLOCK scheme): e4m3 `weight` and fp32 `weight_scale` per [bn, bk] block; the
    activations' dynamic per-group scheme in the config (tokenmill keeps them
    unquantized)."""
    def encode(name, w):
        fw = quantize_fp8_block(w, block)
        return encode_compressed_tensors_fp8_block(fw), fw

    weights = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
               "block_structure": list(block), "dynamic": False, "group_size": None,
               "observer": "minmax"}
    acts = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
            "group_size": block[1], "dynamic": True, "observer": None}
    qc = {"quant_method": "compressed-tensors", "format": "float-quantized",
          "quantization_status": "compressed", "kv_cache_scheme": None,
          "sparsity_config": {},
          "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                        "input_activations": acts,
                                        "output_activations": None,
                                        "format": "float-quantized"}},
          "ignore": ["lm_head", *keep]}
    return write_quantized(src_dir, dst_dir, encode, qc, reference_dir, keep,
                           return_dequantized)
