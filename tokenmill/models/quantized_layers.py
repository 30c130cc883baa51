"""Give the layers a quantized checkpoint quantizes their quantized method, before its
weights are read (models/loader.py `load_model`, between building the model and
`load_weights`).

Which layers: the ones the checkpoint stores quantized, read from the safetensors
headers (names, dtypes and shapes; no data): a dense `Linear` whose checkpoint
weight(s) are e4m3 takes `Fp8BlockLinearMethod` (layers/linear_methods/fp8.py), which
registers `weight` e4m3 and `weight_scale_inv` for the loader to fill. The config is
checked against the files, never trusted alone: a layer the config's
modules_to_not_convert / ignored_layers names but whose weight is fp8, an fp8 weight
without its scale, a scale whose shape does not fit the block size, and any fp8 or
scale tensor no layer takes (a tied or quantized lm_head, a layer the model renames
or transforms on the way in, experts stored already stacked) are each an error naming
the tensor.

An MoE block's `FusedMoE` whose per-expert checkpoint tensors ("...experts.{e}.
{gate_proj,up_proj,down_proj}.weight", Qwen3-MoE-FP8 / DeepSeek-V3) are e4m3 takes
`Fp8BlockFusedMoEMethod`: every expert and all three projections fp8 with their
scales, and the expert intermediate size whole block rows (gate and up share one
stacked scale tensor), else an error naming the tensor or layer. The router stays
unquantized; shared experts are Linears and handled as any.

A packed layer (q | k | v -> qkv_proj, gate | up -> gate_up_proj) is quantized only if
every shard is, and the loader concatenates the shards' `weight_scale_inv` along dim 0
as it does their weights: every shard but the last must be whole block rows (N a
multiple of bn), or its scales would not line up with its rows.

Per-tensor and per-channel scales (no weight_block_size: `weight_scale`, a scalar, [N]
or [N, 1]) load as one-row blocks spanning the row (`per_channel_block`):
`fp8_checkpoint_tensors` turns each `weight_scale` into the `weight_scale_inv` [N, 1]
the methods hold (a per-tensor scale repeated on every row), so fused shards with
different per-tensor scales just concatenate their rows. A static scheme's
`input_scale` tensors are dropped there: the activations are not quantized (W8A16).
"""
from __future__ import annotations

import logging

from torch import nn

from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod, cdiv,
                                                        per_channel_block)
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.models.quantization import Fp8Config

logger = logging.getLogger(__name__)


def packed_sources(model: nn.Module) -> dict[str, list[str]]:
    """Packed target ("qkv_proj") -> the checkpoint modules packed into it, in shard
    order (the model's `packed_modules`)."""
    sources: dict[str, list[str]] = {}
    packed = getattr(model, "packed_modules", {})
    for source, (target, _) in sorted(packed.items(), key=lambda kv: kv[1][1]):
        sources.setdefault(target, []).append(source)
    return sources


def parameter_uses(model: nn.Module) -> dict[int, int]:
    """Parameter id -> how many modules hold it (2 for a head tied to the embedding)."""
    uses: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return uses

FP8_E4M3, FP8_E5M2 = "F8_E4M3", "F8_E5M2"
SCALE_SUFFIX = ".weight_scale_inv"     # block scales (weight_block_size)
ROW_SCALE_SUFFIX = ".weight_scale"     # per-tensor / per-channel scales (no block size)
INPUT_SCALE_SUFFIX = ".input_scale"    # static activation scales: not used
# Scale tensors that no fp8 variant tokenmill loads reads.
UNREAD_SCALE_SUFFIXES = (".activation_scale", ".input_scale_inv")


def _scale_suffix(cfg: Fp8Config) -> str:
    """The suffix of the weight scales this config reads: per tensor / per channel, or
    its block scales' (".weight_scale_inv", compressed-tensors' ".weight_scale")."""
    return ROW_SCALE_SUFFIX if cfg.block_size is None else "." + cfg.block_scale_name


def _unread_scale(cfg: Fp8Config, name: str) -> bool:
    """A scale tensor this config does not read (a checkpoint contradicting its config
    or a variant not implemented)."""
    if name.endswith(UNREAD_SCALE_SUFFIXES):
        return True
    if name.endswith(INPUT_SCALE_SUFFIX):
        return not cfg.static_activations
    read = _scale_suffix(cfg)
    return name.endswith((SCALE_SUFFIX, ROW_SCALE_SUFFIX)) and not name.endswith(read)


def _checkpoint_name(header: dict, name: str) -> str | None:
    """The checkpoint's spelling of a model tensor name (with or without "model.")."""
    for candidate in ("model." + name, name):
        if candidate in header:
            return candidate
    return None


def _check_scale(header: dict, w: str, cfg: Fp8Config, where: str) -> str:
    """The name of fp8 weight `w`'s scales (block scales; no block size: per tensor or
    per channel), checked present and shaped to fit."""
    n, k = header[w][1]
    block = cfg.block_size
    scale = w[:-len(".weight")] + _scale_suffix(cfg)
    if scale not in header:
        kind = "per-tensor / per-channel" if block is None else "block"
        raise ValueError(f"{where}: fp8 tensor {w} has no {kind} scales: {scale} "
                         f"is missing from the checkpoint")
    if block is None:
        if tuple(header[scale][1]) not in ((), (1,), (n,), (n, 1)):
            raise ValueError(f"{where}: {scale} has shape {tuple(header[scale][1])}; "
                             f"{w} {(n, k)} takes one scale per tensor ([] or [1]) or per "
                             f"output row ([{n}] or [{n}, 1])")
        return scale
    bn, bk = block
    want = (cdiv(n, bn), cdiv(k, bk))
    if tuple(header[scale][1]) != want:
        raise ValueError(f"{where}: {scale} has shape {tuple(header[scale][1])}; "
                         f"{w} {(n, k)} in [{bn}, {bk}] blocks needs {want} "
                         f"(weight_block_size does not match the checkpoint)")
    return scale


def _apply_fp8_experts(model: nn.Module, cfg: Fp8Config, header: dict, dtype, where: str,
                       claimed: set[str]) -> int:
    """Give every FusedMoE whose per-expert checkpoint weights are e4m3 the fp8 expert
    method; returns how many."""
    sources = getattr(model, "expert_modules", {})
    count = 0
    for mname, module in list(model.named_modules()):
        if not isinstance(module, FusedMoE):
            continue
        for target in ("gate_up_proj", "down_proj"):  # experts shipped stacked
            w = _checkpoint_name(header, f"{mname}.{target}")
            if w is not None and header[w][0] == FP8_E4M3:
                raise ValueError(f"{where}: tensor {w} is fp8 experts stored stacked: "
                                 f"only per-expert fp8 tensors (experts.E.gate_proj / "
                                 f"up_proj / down_proj) are implemented")
        names = [f"{mname}.{e}.{src}.weight" for e in range(module.num_experts)
                 for src in sources]
        weights = [(n, _checkpoint_name(header, n)) for n in names]
        fp8 = [w for _, w in weights if w is not None and header[w][0] == FP8_E4M3]
        if not fp8:
            continue
        layer = f"MoE layer {mname}"
        plain = [n if w is None else f"{w} ({header[w][0]})"
                 for n, w in weights if w not in fp8]
        if plain:
            raise ValueError(f"{where}: {layer}: {fp8[0]} is fp8 but {plain[0]} is not; "
                             f"fp8 experts load only when every expert's gate, up and down "
                             f"weights are")
        block = cfg.block_size or per_channel_block(module.hidden_size,
                                                    module.intermediate_size)
        bn = block[0]
        if module.intermediate_size % bn:
            raise ValueError(f"{where}: {layer}: expert intermediate size "
                             f"{module.intermediate_size} is not a multiple of the fp8 "
                             f"block's {bn} rows: gate and up block scales cannot be "
                             f"stacked (not supported)")
        ignored = [w for w in fp8 if cfg.ignores(w[:-len(".weight")])]
        if ignored:
            raise ValueError(f"{where}: tensor {ignored[0]} is fp8 but quantization_config "
                             f"lists its module as not converted (modules_to_not_convert / "
                             f"ignored_layers): the checkpoint contradicts its config")
        for w in fp8:
            claimed.update((w, _check_scale(header, w, cfg, where)))
        module.use_method(Fp8BlockFusedMoEMethod(block, per_channel=cfg.block_size is None),
                          dtype)
        count += 1
    return count


def apply_fp8(model: nn.Module, cfg: Fp8Config, header: dict, dtype, where: str) -> int:
    """Give every dense Linear and FusedMoE of `model` whose checkpoint weights are e4m3
    the fp8 block method (its parameters created in `dtype` / the current default
    device); returns how many layers. Raises ValueError naming any fp8 tensor the model
    cannot place."""
    for name, (dt, _) in header.items():
        if dt == FP8_E5M2:
            raise ValueError(f"{where}: tensor {name} is float8_e5m2: e5m2 fp8 weights are "
                             f"not implemented (tokenmill loads e4m3 with block scales)")
        if _unread_scale(cfg, name):
            raise ValueError(f"{where}: tensor {name} is a per-tensor weight scale or a "
                             f"static activation scale, which this quantization_config "
                             f"does not use (weight_block_size {cfg.block_size}, "
                             f"activation_scheme "
                             f"{'static' if cfg.static_activations else 'dynamic'}): the "
                             f"checkpoint contradicts its config, or is a variant tokenmill "
                             f"does not implement")
    sources, uses = packed_sources(model), parameter_uses(model)
    claimed: set[str] = set()
    count = 0
    for mname, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        prefix, _, leaf = mname.rpartition(".")
        shard_modules = [f"{prefix}.{s}" if prefix else s for s in sources.get(leaf, [leaf])]
        weights = [_checkpoint_name(header, m + ".weight") for m in shard_modules]
        if len(weights) > 1 and not any(weights):  # stored fused already (Phi-3's qkv_proj)
            shard_modules = [mname]
            weights = [_checkpoint_name(header, mname + ".weight")]
        fp8 = [w for w in weights if w is not None and header[w][0] == FP8_E4M3]
        if not fp8:
            continue
        layer = f"layer {mname}"
        if len(fp8) != len(weights):
            plain = [f"{m}.weight" + ("" if w is None else f" ({header[w][0]})")
                     for m, w in zip(shard_modules, weights) if w not in fp8]
            raise ValueError(f"{where}: {layer} packs {', '.join(shard_modules)}: "
                             f"{', '.join(fp8)} fp8 but {', '.join(plain)} not; a packed "
                             f"layer is loaded quantized only when every shard is")
        if uses.get(id(module.weight), 0) > 1 or leaf == "lm_head":
            raise ValueError(f"{where}: tensor {fp8[0]} is fp8: a quantized lm_head or a "
                             f"weight tied to the embedding is not implemented (published "
                             f"fp8 checkpoints keep them unquantized)")
        ignored = [w for w, m in zip(weights, shard_modules) if cfg.ignores(m)]
        if ignored:
            raise ValueError(f"{where}: tensor {ignored[0]} is fp8 but quantization_config "
                             f"lists its module as not converted (modules_to_not_convert / "
                             f"ignored_layers): the checkpoint contradicts its config")
        block = cfg.block_size or per_channel_block(module.in_features)
        bn = block[0]
        for i, w in enumerate(weights):
            n, k = header[w][1]
            if i < len(weights) - 1 and n % bn:
                raise ValueError(f"{where}: {layer} packs {', '.join(shard_modules)}; "
                                 f"{w} has {n} rows, not a multiple of the fp8 block's "
                                 f"{bn}: its block scales cannot be concatenated with the "
                                 f"next shard's (not supported)")
            claimed.update((w, _check_scale(header, w, cfg, where)))
        module.use_method(Fp8BlockLinearMethod(block, per_channel=cfg.block_size is None),
                         dtype)
        count += 1
    count += _apply_fp8_experts(model, cfg, header, dtype, where, claimed)
    unused = [n for n in header if n.endswith(INPUT_SCALE_SUFFIX)]
    if unused:
        logger.info("%s: activation_scheme static: the %d input_scale tensors are not used; "
                    "activations stay unquantized (W8A16), the GEMMs use the dequantized "
                    "weights", where, len(unused))
    for name, (dt, _) in header.items():
        if name in claimed or not (dt == FP8_E4M3 or name.endswith(_scale_suffix(cfg))):
            continue
        if ".experts." in name:
            raise ValueError(f"{where}: tensor {name} is an fp8 MoE expert tensor no "
                             f"expert layer of {type(model).__name__} takes (fp8 experts "
                             f"load as per-expert gate_proj / up_proj / down_proj weights "
                             f"with their scales)")
        raise ValueError(f"{where}: fp8 tensor {name} is not one {type(model).__name__} can "
                         f"place (no dense layer of that name takes fp8 weights with block "
                         f"scales); refusing rather than running without it")
    return count


def fp8_checkpoint_tensors(tensors, header: dict, cfg: Fp8Config):
    """The checkpoint's (name, tensor) pairs as the fp8 layers take them: without
    weight_block_size each `weight_scale` (scalar, [N] or [N, 1]) becomes the
    `weight_scale_inv` [N, 1] of one-row blocks (a per-tensor scale on every row);
    compressed-tensors' block `weight_scale` is the `weight_scale_inv` (the same
    dequantization factor per block, under another name); a static scheme's
    `input_scale` tensors are dropped (not used)."""
    for name, tensor in tensors:
        if cfg.static_activations and name.endswith(INPUT_SCALE_SUFFIX):
            continue
        if (cfg.block_size is not None and cfg.block_scale_name == "weight_scale"
                and name.endswith(ROW_SCALE_SUFFIX)):
            yield name + "_inv", tensor.float()
            continue
        if cfg.block_size is None and name.endswith(ROW_SCALE_SUFFIX):
            weight = name[:-len(ROW_SCALE_SUFFIX)] + ".weight"
            n = header[weight][1][0] if weight in header else tensor.numel()
            scale = tensor.float().reshape(-1, 1)
            if scale.shape[0] == 1 and n != 1:
                scale = scale.expand(n, 1)
            yield name + "_inv", scale.contiguous()
            continue
        yield name, tensor
