"""Give the layers an integer-quantized checkpoint (GPTQ, AWQ, compressed-tensors)
stores quantized their format's method, before its weights are read (models/loader.py
`load_model`, between building the model and `load_weights`); and after loading,
convert them into the canonical form (`finish_int_quant`).

Which layers: read from the safetensors headers (names, dtypes, shapes; no data). A
dense `Linear` whose checkpoint module has `<module>.qweight` (gptq, awq) or
`<module>.weight_packed` (compressed-tensors) takes its format's `IntLinearMethod`,
which registers the checkpoint's tensors under their names for the loader; every
tensor the layout reads is checked present with its dtype and shape first. A packed
layer (q | k | v, gate | up) is quantized only if every shard is, and every shard
but the last must end on a word of each tensor packed along the output dim. A
`FusedMoE` whose per-expert tensors ("...experts.{e}.{gate,up,down}_proj.qweight")
are quantized takes `QuantizedFusedMoEMethod`: every expert and projection, else an
error naming the tensor.

A vision-language checkpoint's language-model tensors ("model.language_model.*") are
found under the names its text model gives them. A quantized lm_head (GPTQ's
`lm_head: true`) takes its format's method like any layer (the int8 greedy screen,
which needs a float lm_head, is then not built: the quantized kernel reads fewer
bytes). Refused by name: a quantized weight tied to the embedding, a quantized
lm_head with tensor parallelism, a layer the config's ignore list names but whose
weights are quantized, a missing or mis-shaped tensor, a packed layer half quantized,
and any tensor of the format no layer takes (experts stored stacked, layers a model
renames or transforms on the way in).
"""
from __future__ import annotations

from torch import nn

from tokenmill.models.layers.linear import Linear, QKVParallel
from tokenmill.models.layers.linear_methods.awq import AwqLayout, AwqLinearMethod
from tokenmill.models.layers.linear_methods.compressed_tensors import (
    CompressedTensorsLayout, CompressedTensorsLinearMethod)
from tokenmill.models.layers.linear_methods.gptq import GptqLayout, GptqLinearMethod
from tokenmill.models.layers.linear_methods.int_layout import IntLayout
from tokenmill.models.layers.linear_methods.quantized_moe import QuantizedFusedMoEMethod
from tokenmill.models.layers.moe import FusedMoE
from tokenmill.models.quantized_layers import packed_sources, parameter_uses
from tokenmill.models.quantization import (AwqConfig, CompressedTensorsConfig, GptqConfig,
                                           ignores_module)
from tokenmill.models.weight_names import text_model_name

OPTIONAL_KINDS = ("g_idx", "weight_g_idx")


def _checkpoint_name(header: dict, name: str) -> str | None:
    for candidate in ("model." + name, name):
        if candidate in header:
            return candidate
    return None


def _text_model_names(header: dict) -> dict[str, str]:
    """A vision-language checkpoint's language-model tensors by the name its text model
    gives them ("model.language_model.layers.0..." -> "model.layers.0..."), each to
    the checkpoint's own spelling (the models' map_checkpoint renames them so)."""
    return {text_model_name(n): n for n in header if text_model_name(n) != n}


def _layout(cfg, optional: set[str]) -> tuple[IntLayout, type]:
    """The format's layout (with the optional tensors the checkpoint has) and method."""
    if isinstance(cfg, GptqConfig):
        return (GptqLayout(cfg.bits, cfg.group_size, cfg.v1_zeros, "g_idx" in optional),
                GptqLinearMethod)
    if isinstance(cfg, AwqConfig):
        return AwqLayout(cfg.group_size), AwqLinearMethod
    if isinstance(cfg, CompressedTensorsConfig):
        return (CompressedTensorsLayout(cfg.bits, cfg.group_size, cfg.symmetric,
                                        "weight_g_idx" in optional),
                CompressedTensorsLinearMethod)
    raise TypeError(f"not an integer-format config: {cfg!r}")


class Placement:
    """The checks of one checkpoint against one format; `claimed`: the tensors placed."""

    def __init__(self, cfg, header: dict, where: str):
        self.cfg, self.header, self.where = cfg, header, where
        self.marker = "weight_packed" if isinstance(cfg, CompressedTensorsConfig) else "qweight"
        self.kinds = _layout(cfg, set(OPTIONAL_KINDS))[0].KINDS
        self.claimed: set[str] = set()
        self.renamed = _text_model_names(header)

    def prefix(self, module: str) -> str | None:
        """The checkpoint's spelling of `module` when it is stored quantized."""
        name = f"{module}.{self.marker}"
        w = _checkpoint_name(self.header, name)
        if w is None:
            w = self.renamed.get(_checkpoint_name(self.renamed, name))
        return None if w is None else w[:-len(self.marker) - 1]

    def layout(self, prefixes: list[str], what: str) -> tuple[IntLayout, type]:
        """The layout of matrices `prefixes` (one packed layer or MoE block), which
        must agree on their optional tensors."""
        have = [{k for k in OPTIONAL_KINDS if f"{p}.{k}" in self.header} for p in prefixes]
        for p, h in zip(prefixes, have):
            if h != have[0]:
                odd = sorted(h ^ have[0])[0]
                raise ValueError(f"{self.where}: {what}: {prefixes[0]} and {p} differ in "
                                 f"having {odd}; one layout per layer is implemented")
        return _layout(self.cfg, have[0])

    def check(self, layout: IntLayout, prefix: str, k: int, n: int | None = None) -> int:
        """Check matrix `prefix`'s tensors (K = k; N = n, or read from them); returns N."""
        shapes = {kind: self.header[f"{prefix}.{kind}"][1] for kind in layout.KINDS
                  if f"{prefix}.{kind}" in self.header}
        n = layout.out_features(shapes) if n is None else n
        for kind, spec in layout.specs(k, n).items():
            name = f"{prefix}.{kind}"
            if name not in self.header:
                raise ValueError(f"{self.where}: {layout.name} tensor {name} is missing "
                                 f"from the checkpoint ({prefix} is stored quantized)")
            dtype, shape = self.header[name]
            if dtype not in spec.header_dtypes:
                raise ValueError(f"{self.where}: {name} is {dtype}; {layout.name} stores it "
                                 f"as {' / '.join(spec.header_dtypes)}")
            if tuple(shape) != spec.shape:
                raise ValueError(f"{self.where}: {name} has shape {tuple(shape)}; a "
                                 f"[{n}, {k}] matrix in {layout.describe()} needs "
                                 f"{spec.shape}")
            self.claimed.add(name)
        return n

    def ignored(self, prefixes: list[str]) -> None:
        bad = [p for p in prefixes if ignores_module(getattr(self.cfg, "ignored", ()), p)]
        if bad:
            raise ValueError(f"{self.where}: tensor {bad[0]}.{self.marker} is quantized but "
                             f"the quantization_config lists {bad[0]} as not converted "
                             f"(ignore / modules_to_not_convert): the checkpoint contradicts "
                             f"its config")


def _rank_shards(module: Linear, shards: list[int], tp_size: int, where: str) -> tuple:
    """The rows of each checkpoint matrix of `module` on this tensor-parallel rank
    (`shards`: the checkpoint's, whole): its heads of q / k / v, its share of each
    packed segment or of the whole; a row-parallel or replicated layer keeps its rows."""
    if tp_size == 1 or module.tp in ("replicated", "row"):
        return tuple(shards)
    if len(shards) == 1:
        return (module.out_features,)
    if isinstance(module.tp, QKVParallel):
        spec = module.tp
        return tuple(n for n in (spec.q_rows, spec.k_rows, spec.v_rows) if n)
    if module.output_sizes and len(module.output_sizes) == len(shards):
        return tuple(s if isinstance(s, int) else sum(s) for s in module.output_sizes)
    raise ValueError(f"{where}: cannot tell the rows per rank of its checkpoint matrices "
                     f"{shards} (tensor_parallel_size {tp_size})")


def _apply_linears(model: nn.Module, pl: Placement, dtype, tp_size: int = 1) -> int:
    sources, uses = packed_sources(model), parameter_uses(model)
    count = 0
    for mname, module in list(model.named_modules()):
        if not isinstance(module, Linear):
            continue
        parent, _, leaf = mname.rpartition(".")
        shard_modules = [f"{parent}.{s}" if parent else s for s in sources.get(leaf, [leaf])]
        prefixes = [pl.prefix(m) for m in shard_modules]
        if len(prefixes) > 1 and not any(prefixes):  # stored fused already (Phi-3)
            shard_modules, prefixes = [mname], [pl.prefix(mname)]
        quantized = [p for p in prefixes if p is not None]
        if not quantized:
            continue
        layer = f"layer {mname}"
        if len(quantized) != len(prefixes):
            plain = [m for m, p in zip(shard_modules, prefixes) if p is None]
            raise ValueError(f"{pl.where}: {layer} packs {', '.join(shard_modules)}: "
                             f"{quantized[0]}.{pl.marker} is quantized but {plain[0]} is "
                             f"not; a packed layer loads quantized only when every shard is")
        if uses.get(id(getattr(module, "weight", None)), 0) > 1:
            raise ValueError(f"{pl.where}: tensor {quantized[0]}.{pl.marker} is quantized: a "
                             f"quantized weight tied to the embedding is not implemented")
        if leaf == "lm_head" and (tp_size > 1 or mname != "lm_head"):
            # (TP splits the lm_head by vocabulary; a quantized one would need its
            # packed tensors cut the same way)
            raise ValueError(f"{pl.where}: tensor {quantized[0]}.{pl.marker} is quantized: a "
                             f"quantized lm_head " + ("with tensor parallelism (tensor_"
                                                      f"parallel_size {tp_size})" if tp_size > 1
                                                      else f"at {mname}") +
                             " is not implemented")
        pl.ignored(quantized)
        layout, method_cls = pl.layout(quantized, layer)
        shards = []
        # The checkpoint holds the whole matrices: a row-parallel rank's K is a share.
        k_full = module.in_features * (tp_size if module.tp == "row" else 1)
        for i, p in enumerate(quantized):
            n = pl.check(layout, p, k_full)
            if len(quantized) > 1 and i < len(quantized) - 1 and not layout.whole_words(n):
                raise ValueError(f"{pl.where}: {layer} packs {', '.join(shard_modules)}; "
                                 f"{p} has {n} rows, which end inside a packed int32 word: "
                                 f"its tensors cannot be concatenated with the next shard's "
                                 f"(not supported)")
            shards.append(n)
        shards = _rank_shards(module, shards, tp_size, f"{pl.where}: {layer}")
        if sum(shards) != module.out_features:
            raise ValueError(f"{pl.where}: {layer} has {module.out_features} rows; its "
                             f"checkpoint matrices {', '.join(quantized)} have {shards}")
        # A row-parallel act-order share keeps every group's scales (act_order_share.py).
        share = tp_size > 1 and module.tp == "row" and layout.keeps_groups_on_row_split()
        module.use_method(method_cls(layout, tuple(shards), k_full if share else None), dtype)
        count += 1
    return count


def _apply_experts(model: nn.Module, pl: Placement, dtype, tp_size: int = 1) -> int:
    sources = getattr(model, "expert_modules", {})
    count = 0
    for mname, module in list(model.named_modules()):
        if not isinstance(module, FusedMoE):
            continue
        mats = [(e, src) for e in range(module.num_experts) for src in sources]
        prefixes = [pl.prefix(f"{mname}.{e}.{src}") for e, src in mats]
        quantized = [p for p in prefixes if p is not None]
        if not quantized:
            continue
        layer = f"MoE layer {mname}"
        if len(quantized) != len(prefixes):
            plain = [f"{mname}.{e}.{src}" for (e, src), p in zip(mats, prefixes) if p is None]
            raise ValueError(f"{pl.where}: {layer}: {quantized[0]}.{pl.marker} is quantized "
                             f"but {plain[0]} is not; quantized experts load only when "
                             f"every expert's gate, up and down projections are")
        pl.ignored(quantized)
        layout, _ = pl.layout(quantized, layer)
        h, i = module.hidden_size, module.intermediate_size
        i_full = i * tp_size  # (a tensor-parallel rank's experts hold a share of I)
        for (e, src), p in zip(mats, quantized):
            target = sources[src][0]
            k, n = (i_full, h) if target == "down_proj" else (h, i_full)
            pl.check(layout, p, k, n)
        if not layout.whole_words(i):
            raise ValueError(f"{pl.where}: {layer}: expert intermediate size {i} ends inside "
                             f"a packed int32 word: gate and up cannot be stacked "
                             f"(not supported)")
        share = tp_size > 1 and layout.keeps_groups_on_row_split()  # (down_proj's input)
        module.use_method(QuantizedFusedMoEMethod(layout, down_groups_k=i_full if share
                                                  else None), dtype)
        count += 1
    return count


def apply_int_quant(model: nn.Module, cfg, header: dict, dtype, where: str,
                    tp_size: int = 1) -> int:
    """Give every Linear and FusedMoE of `model` stored quantized in `cfg`'s format its
    method (parameters created in `dtype` / the current default device); returns how
    many layers. Raises ValueError naming any of the format's tensors the model
    cannot place. `tp_size` > 1: `model` is one tensor-parallel rank's (its layers
    hold their share; the checkpoint's tensors are checked whole)."""
    pl = Placement(cfg, header, where)
    count = (_apply_linears(model, pl, dtype, tp_size)
             + _apply_experts(model, pl, dtype, tp_size))
    for name in header:
        kind = name.rpartition(".")[2]
        if name in pl.claimed or kind not in pl.kinds:
            continue
        if ".experts." in name:
            raise ValueError(f"{where}: tensor {name} is a {cfg.method} MoE expert tensor no "
                             f"expert layer of {type(model).__name__} takes (quantized "
                             f"experts load as per-expert gate_proj / up_proj / down_proj)")
        raise ValueError(f"{where}: {cfg.method} tensor {name} is not one "
                         f"{type(model).__name__} can place (no layer of that name takes "
                         f"it in this layout); refusing rather than running without it")
    return count


def finish_int_quant(model: nn.Module) -> None:
    """After loading: convert every quantized FusedMoE's per-expert tensors into the
    canonical form. (The platform keeps a quantized expert method as it is, so nothing
    else would; a quantized Linear converts when the platform hands it its kernels:
    `QuantizedLinearMethod.for_platform`, then `set_method`.)"""
    for module in model.modules():
        if isinstance(module, FusedMoE) and isinstance(module.method, QuantizedFusedMoEMethod):
            module.method.process_weights_after_loading(module)
