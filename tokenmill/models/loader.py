"""Build a model and fill it from a Hugging Face folder of safetensors."""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenmill.models.checkpoint_io import (checkpoint_header, iter_checkpoint,
                                            iter_checkpoint_lazy)
from tokenmill.models.int_quant_layers import apply_int_quant, finish_int_quant
from tokenmill.models.kv_scales import KVScales
from tokenmill.models.layers.linear_methods.int_layout import INT_TENSOR_KINDS
from tokenmill.models.quantization import check_quantization, fp8_config, int_quant_config
from tokenmill.models.quantize_at_load import quantize_model, resolve_quantization
from tokenmill.models.quantized_layers import apply_fp8, fp8_checkpoint_tensors
from tokenmill.models.registry import resolve_model_class
from tokenmill.platforms.cpu import settle_vector_math

logger = logging.getLogger(__name__)


def mapped_checkpoint(model: nn.Module, tensors):
    """A model's `map_checkpoint(name, tensor)` may rename, split or drop tensors."""
    mapper = getattr(model, "map_checkpoint", None)
    for name, tensor in tensors:
        if mapper is None:
            yield name, tensor
        else:
            yield from mapper(name, tensor)


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


# Per-expert tensor kinds -> the suffix of the stacked parameter they fill: the weight,
# an fp8 checkpoint's block scales (stacked the same way, in block rows), and the
# integer formats' tensors ("qweight" -> "{target}_qweight": quantized_moe.py).
EXPERT_TENSORS = {"weight": "", "weight_scale_inv": "_scale_inv",
                  **{kind: "_" + kind for kind in INT_TENSOR_KINDS}}
# Longest first: a stacked parameter's name ends in exactly one of them.
_EXPERT_SUFFIXES = sorted((s for s in EXPERT_TENSORS.values() if s), key=len, reverse=True)


def _expert_name(ckpt_name: str, experts: dict) -> tuple[str, int, int] | None:
    """A per-expert HF name -> (stacked parameter, expert index, shard), else None.

    "model.layers.1.mlp.experts.3.up_proj.weight" with experts
    {"up_proj": ("gate_up_proj", 1), ...} -> ("layers.1.mlp.experts.gate_up_proj", 3, 1);
    "....experts.3.up_proj.weight_scale_inv" -> ("....experts.gate_up_proj_scale_inv", 3, 1).
    """
    parts = ckpt_name.removeprefix("model.").split(".")
    if len(parts) < 4 or parts[-1] not in EXPERT_TENSORS or parts[-2] not in experts:
        return None
    if parts[-4] != "experts" or not parts[-3].isdigit():
        return None
    target, shard = experts[parts[-2]]
    return ".".join(parts[:-3] + [target + EXPERT_TENSORS[parts[-1]]]), int(parts[-3]), shard


def _expert_suffix(name: str) -> str:
    """The EXPERT_TENSORS suffix a stacked parameter's name ends in ("" for the weight)."""
    return next((s for s in _EXPERT_SUFFIXES if name.endswith(s)), "")


def _expert_target(name: str) -> str:
    """"layers.1.mlp.experts.gate_up_proj_scale_inv" -> "gate_up_proj" (expert_modules')."""
    leaf = name.rsplit(".", 1)[-1]
    return leaf[:len(leaf) - len(_expert_suffix(leaf))]


def _shard_dim(param) -> int:
    """The dim a packed parameter's checkpoint shards concatenate along: 0, or the one
    an integer format's layout marks (GPTQ / AWQ keep the output dim last)."""
    return getattr(param, "shard_dim", 0)


# Checkpoint tensors that no parameter takes, on purpose, for every model. Anything else
# that matches no parameter is an error naming it: a tensor the loader cannot place (an
# FP8 scale, a GPTQ qzeros) means the weights it did place are not what the model needs.
# A model adds its own (a vision tower it does not run, MTP layers) in `map_checkpoint`,
# which drops them with a comment saying why.
UNUSED_TENSOR_SUFFIXES = (
    "rotary_emb.inv_freq",  # rotary frequencies: recomputed from the config, never learned
)


def load_weights(model: nn.Module, model_dir: str, tensors=None, shard_plan=None,
                 kv_scales: KVScales | None = None) -> None:
    """Fill every parameter of `model` from the checkpoint, or raise naming what is
    missing, what cannot be placed (a tensor matching no parameter, outside
    UNUSED_TENSOR_SUFFIXES and what the model's map_checkpoint drops) or what has the
    wrong shape or kind (an integer or float8 tensor for a floating parameter).

    `tensors`: the (name, tensor) pairs to load instead of every tensor in `model_dir`
    (a draft head that lives inside the target's checkpoint reads only its own).

    A model may declare `packed_modules` (checkpoint matrices concatenated into one
    parameter, e.g. q/k/v -> qkv_proj) and `expert_modules` (per-expert matrices
    "...experts.{e}.{name}.weight" copied into row e of a stacked parameter
    "...experts.{target}" [E, ...], at shard i of its dim 1 (equal-sized shards), as
    they arrive; an fp8 checkpoint's "...{name}.weight_scale_inv" likewise into
    "...experts.{target}_scale_inv", an integer format's "...{name}.qweight" into
    "...experts.{target}_qweight", ...: EXPERT_TENSORS). A checkpoint that already
    stores the stacked tensors under the parameter's own name (HF's fused
    "experts.gate_up_proj") loads as is.

    A parameter marked with a `shard_dim` (an integer format's: GPTQ / AWQ keep the
    output dim last) takes its packed shards concatenated along that dim (per expert:
    dim 1 + shard_dim of the stacked parameter) instead of dim 0.

    `shard_plan` (tensor parallelism, models/tensor_parallel.py): the (lazily read)
    checkpoint tensors are cut to this rank's slice before they are copied.

    `kv_scales` (models/kv_scales.py): per-layer FP8 KV cache scales (k_scale, v_scale,
    ...) that match no parameter are kept there for `KVScales.apply`; without it they
    are refused as any unplaced tensor.
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    packed = getattr(model, "packed_modules", {})
    experts = getattr(model, "expert_modules", {})
    # Shards of a packed parameter wait here until all of them arrived.
    pending: dict[str, dict[int, torch.Tensor]] = {}
    num_shards = {}
    for _, (target, _) in packed.items():
        num_shards[target] = num_shards.get(target, 0) + 1
    num_expert_shards = {}
    for _, (target, _) in experts.items():
        num_expert_shards[target] = num_expert_shards.get(target, 0) + 1
    expert_seen: dict[str, set[tuple[int, int]]] = {}  # stacked parameter -> (expert, shard)
    loaded = set()

    def unknown(ckpt_name: str) -> None:
        raise ValueError(f"checkpoint {model_dir}: tensor {ckpt_name} matches no parameter "
                         f"of {type(model).__name__} (a format or layout tokenmill does not "
                         f"load; refusing rather than running without it)")

    source = iter_checkpoint(model_dir) if tensors is None else tensors
    for ckpt_name, tensor in mapped_checkpoint(model, source):
        if ckpt_name.endswith(UNUSED_TENSOR_SUFFIXES):
            continue
        expert = _expert_name(ckpt_name, experts) if experts else None
        if expert is not None:
            name, e, shard = expert
            if name not in params:
                unknown(ckpt_name)
                continue
            param = params[name]
            if e >= param.shape[0]:
                raise ValueError(f"weight {ckpt_name}: expert {e} out of range (the model "
                                 f"has {param.shape[0]} experts)")
            if shard_plan is not None:
                tensor = shard_plan.take(name, shard, tensor)
            n_shards = num_expert_shards[_expert_target(name)]
            dim = _shard_dim(param)
            rows = param.shape[1 + dim] // n_shards
            _copy(param[e].narrow(dim, shard * rows, rows), tensor, ckpt_name)
            seen = expert_seen.setdefault(name, set())
            seen.add((e, shard))
            if len(seen) == param.shape[0] * n_shards:
                loaded.add(name)
            continue
        name, shard = _param_name(ckpt_name, packed)
        if name not in params:
            if kv_scales is None or not kv_scales.take(ckpt_name, tensor):
                unknown(ckpt_name)
            continue
        if shard_plan is not None:
            tensor = shard_plan.take(name, shard, tensor)
        if shard is None:
            _copy(params[name], tensor, ckpt_name)
            loaded.add(name)
            continue
        parts = pending.setdefault(name, {})
        parts[shard] = tensor
        target_short = name.rsplit(".", 2)[-2]
        if len(parts) == num_shards[target_short]:
            _copy(params[name], torch.cat([parts[i] for i in range(len(parts))],
                                          dim=_shard_dim(params[name])), name)
            loaded.add(name)
            del pending[name]
    if pending:
        name, parts = sorted(pending.items())[0]
        prefix, target, suffix = name.rsplit(".", 2)
        absent = [f"{prefix}.{source}.{suffix}" for source, (t, shard) in packed.items()
                  if t == target and shard not in parts]
        raise ValueError(f"checkpoint {model_dir} lacks {', '.join(absent)} (packed into "
                         f"{name}; incomplete: {sorted(pending)})")
    for name, seen in expert_seen.items():
        if name not in loaded:
            suffix = _expert_suffix(name)
            kind = next(("." + k for k, v in EXPERT_TENSORS.items() if v and v == suffix), "")
            shards = {shard: source + kind for source, (target, shard) in experts.items()
                      if target == _expert_target(name)}
            absent = [f"{e}.{shards[s]}" for e in range(params[name].shape[0])
                      for s in sorted(shards) if (e, s) not in seen]
            raise ValueError(f"checkpoint {model_dir} lacks experts of {name}: "
                             f"{', '.join(absent[:8])}" + (" ..." if len(absent) > 8 else ""))
    missing = [n for n in params if n not in loaded]
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False)
    if "lm_head.weight" in missing and tied:
        missing.remove("lm_head.weight")
    if missing:
        raise ValueError(f"checkpoint {model_dir} lacks weights for: {missing[:8]}"
                         + (" ..." if len(missing) > 8 else ""))


# Checkpoint dtypes a floating parameter takes as values: copy_ would convert anything
# else too (int32-packed nibbles, e4m3 without its scale) into numbers that are not
# the weight.
_VALUE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _copy(param: nn.Parameter, tensor: torch.Tensor, name: str) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight {name}: checkpoint shape {tuple(tensor.shape)} != "
                         f"model shape {tuple(param.shape)}")
    if not param.is_floating_point() and (tensor.is_floating_point()
                                          or tensor.dtype == torch.bool):
        # An integer format's packed words or indices: integers only, never values.
        raise ValueError(f"weight {name}: checkpoint dtype {tensor.dtype} where the "
                         f"quantized layer holds integers ({param.dtype})")
    if param.is_floating_point() and param.dtype not in _VALUE_DTYPES:
        # A quantized layer's parameter (fp8 weights): its own dtype and nothing else.
        if tensor.dtype != param.dtype:
            raise ValueError(f"weight {name}: checkpoint dtype {tensor.dtype} where the "
                             f"quantized layer holds {param.dtype}")
    elif param.is_floating_point() and tensor.dtype not in _VALUE_DTYPES:
        raise ValueError(f"weight {name}: checkpoint dtype {tensor.dtype} is not a plain "
                         f"floating-point weight (a quantized checkpoint without its "
                         f"quantization_config?); tokenmill loads bf16 / fp16 / fp32 weights")
    with torch.no_grad():
        param.copy_(tensor)


def load_model(model_dir: str, hf_config: dict, dtype: torch.dtype,
               device: torch.device, platform, tp_group=None,
               quantization: str | None = None, whole_vocab_io: bool = False) -> nn.Module:
    """Build and fill the model, then let `platform` (tokenmill.platforms: the engine's)
    hand its kernel decisions to the layers: packed bf16
    weights, GEMMs widened to its gemm dtype (see layers/linear_methods/), native kernels.
    `tp_group` (tokenmill.executor.tp_group.TPGroup): build and load this rank's shard
    of the model (models/tensor_parallel.py). `quantization` (--quantization): an
    unquantized checkpoint's weights are quantized to it after loading
    (models/quantize_at_load.py); a quantized checkpoint's own method is accepted.
    Every format shards with tensor parallelism (its tensors cut with the weights, or
    a split that would cut a block, packed word or group refused by name).
    `whole_vocab_io` (tensor parallelism with a draft model): every rank gathers the
    embedding and lm_head rows; rank 0 keeps them whole as `model.whole_vocab_io`
    (tensor_parallel.whole_vocab_io), the drafter's."""
    where = f"checkpoint {model_dir}"
    check_quantization(hf_config, where)
    at_load = resolve_quantization(quantization, hf_config, where)
    fp8 = fp8_config(hf_config, where)
    intq = int_quant_config(hf_config, where)
    cls = resolve_model_class(hf_config)
    tp = tp_group is not None and tp_group.size > 1
    if tp:
        from tokenmill.models import tensor_parallel
        tensor_parallel.check_divisible(hf_config, tp_group.size, cls)
        if platform.tensor_parallel_size != tp_group.size:
            raise ValueError("a tensor-parallel model needs a platform made for "
                             f"{tensor_parallel.TP_FIELD}={tp_group.size}")
    if torch.device(device).type == "cpu":  # before the model's first sin / cos / log
        settle_vector_math()
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(tensor_parallel.rank_config(hf_config, tp_group.size, cls) if tp
                        else hf_config)
            if fp8 is not None:
                # The layers the checkpoint quantizes register its layout before loading.
                header = checkpoint_header(model_dir)
                n = apply_fp8(model, fp8, header, dtype, where)
                logger.info("%s: %d layers (Linear, MoE experts) load fp8 weights with %s "
                            "scales (activations stay %s)", where, n,
                            "per-tensor / per-channel" if fp8.block_size is None
                            else f"{list(fp8.block_size)} block", dtype)
                if n == 0:
                    logger.warning("%s: quantization_config says fp8 but no layer's weights "
                                   "are e4m3: loading it as an unquantized checkpoint", where)
            if intq is not None:
                n = apply_int_quant(model, intq, checkpoint_header(model_dir), dtype, where,
                                    tp_group.size if tp else 1)
                logger.info("%s: %d layers (Linear, MoE experts) load %s weights "
                            "(activations stay %s)", where, n, intq.method, dtype)
                if n == 0:
                    logger.warning("%s: quantization_config says %s but no layer's weights "
                                   "are stored in it: loading it as an unquantized "
                                   "checkpoint", where, intq.method)
    finally:
        torch.set_default_dtype(torch_default)
    kv_scales = KVScales()
    if tp:
        # Quantized layers cut their scales, packed words and groups with the weights
        # (their methods' `tp_rules`), or refuse a split that would cut one in two.
        plan = tensor_parallel.ShardPlan(model, hf_config, tp_group.rank, tp_group.size)
        tensors = iter_checkpoint_lazy(model_dir)
        if fp8 is not None:
            tensors = fp8_checkpoint_tensors(tensors, header, fp8)
        load_weights(model, model_dir, tensors, shard_plan=plan, kv_scales=kv_scales)
        tensor_parallel.shard_model(model, tp_group, hf_config["vocab_size"])
        if whole_vocab_io:
            io = tensor_parallel.whole_vocab_io(model, tp_group, hf_config["vocab_size"])
            model.whole_vocab_io = io if tp_group.rank == 0 else None
    else:
        load_weights(model, model_dir, None if fp8 is None else
                     fp8_checkpoint_tensors(iter_checkpoint(model_dir), header, fp8),
                     kv_scales=kv_scales)
    # Per-tensor scales: the same on every tensor-parallel rank (each holds its heads).
    kv_scales.apply(model, where)
    if intq is not None:
        finish_int_quant(model)
    if at_load is not None:
        quantize_model(model, at_load, where, tp_group if tp else None)
    platform.prepare_model(model)
    # Rotary tables stay fp32 (computed as HF computes them); everything else in dtype.
    return model.eval().requires_grad_(False)
