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
"""
from __future__ import annotations

from torch import nn

from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod, cdiv)
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.models.quantization import Fp8Config

FP8_E4M3, FP8_E5M2 = "F8_E4M3", "F8_E5M2"
SCALE_SUFFIX = ".weight_scale_inv"
# Scale tensors of fp8 variants not implemented: per-tensor weight scales and the
# static activation scales.
UNREAD_SCALE_SUFFIXES = (".weight_scale", ".input_scale", ".activation_scale",
                         ".input_scale_inv")


def _checkpoint_name(header: dict, name: str) -> str | None:
    """The checkpoint's spelling of a model tensor name (with or without "model.")."""
    for candidate in ("model." + name, name):
        if candidate in header:
            return candidate
    return None


def _check_scale(header: dict, w: str, block, where: str) -> str:
    """The name of fp8 weight `w`'s block scales, checked present and shaped to fit."""
    bn, bk = block
    n, k = header[w][1]
    scale = w[:-len(".weight")] + SCALE_SUFFIX
    if scale not in header:
        raise ValueError(f"{where}: fp8 tensor {w} has no block scales: {scale} "
                         f"is missing from the checkpoint")
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
        bn = cfg.block_size[0]
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
            claimed.update((w, _check_scale(header, w, cfg.block_size, where)))
        module.use_method(Fp8BlockFusedMoEMethod(cfg.block_size), dtype)
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
        if name.endswith(UNREAD_SCALE_SUFFIXES):
            raise ValueError(f"{where}: tensor {name} is a per-tensor weight scale or a "
                             f"static activation scale, which tokenmill does not implement "
                             f"(it loads block-scaled fp8: weight_scale_inv per block, "
                             f"dynamic activations)")
    bn, bk = cfg.block_size
    packed = getattr(model, "packed_modules", {})
    sources: dict[str, list[str]] = {}  # packed target -> checkpoint modules, shard order
    for source, (target, shard) in sorted(packed.items(), key=lambda kv: kv[1][1]):
        sources.setdefault(target, []).append(source)
    uses: dict[int, int] = {}  # parameter id -> modules holding it (a tied head)
    for _, p in model.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
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
        for i, w in enumerate(weights):
            n, k = header[w][1]
            if i < len(weights) - 1 and n % bn:
                raise ValueError(f"{where}: {layer} packs {', '.join(shard_modules)}; "
                                 f"{w} has {n} rows, not a multiple of the fp8 block's "
                                 f"{bn}: its block scales cannot be concatenated with the "
                                 f"next shard's (not supported)")
            claimed.update((w, _check_scale(header, w, cfg.block_size, where)))
        module.use_method(Fp8BlockLinearMethod(cfg.block_size), dtype)
        count += 1
    count += _apply_fp8_experts(model, cfg, header, dtype, where, claimed)
    for name, (dt, _) in header.items():
        if name in claimed or not (dt == FP8_E4M3 or name.endswith(SCALE_SUFFIX)):
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
