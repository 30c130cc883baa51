"""Which quantized checkpoint formats the engine loads, decided before any weight is read.

A quantized checkpoint stores packed or low-precision weights beside scale tensors. Read
as if it were a bf16 one, its values land in the parameters without their scales and the
model generates noise that looks like output. So a `quantization_config` (or the older
`compression_config` of compressed-tensors) is refused by name unless its method is in
IMPLEMENTED; a format gains an entry here together with its linear method and kernels.

Implemented: "fp8", e4m3 weights, for the dense Linear layers and MoE experts
(`parse_fp8_config` validates the config here; models/quantized_layers.py gives the
layers the checkpoint quantizes their method before the weights load), with
- block scales (DeepSeek-V3 / Qwen -FP8: `weight_block_size` [bn, bk],
  `weight_scale_inv` per block), or
- per-tensor or per-channel scales (no weight_block_size: `weight_scale`, a scalar or
  one per output row, as the "FP8" / "FP8-Dynamic" releases store them), loaded as
  one-row blocks.
Activations stay unquantized (W8A16), so `activation_scheme: static` is accepted and
its `input_scale` tensors are not used. e5m2 is refused by name. compressed-tensors'
"float-quantized" FP8 (per-tensor / per-channel `weight_scale`, llm-compressor's FP8 /
FP8-Dynamic) maps onto the same per-row method (`parse_ct_fp8_config`).

The integer formats, weights only (activations stay in the model's dtype): "gptq"
(4 / 8 bits, any group size, act-order, both zero-point conventions), "awq" (4-bit
GEMM layout with zero points) and "compressed-tensors" pack-quantized W4A16 / W8A16
(group or channel scales, symmetric or not); `int_quant_config` validates them into
`GptqConfig` / `AwqConfig` / `CompressedTensorsConfig` (models/int_quant_layers.py
places them). Their variants not implemented are refused by name: other bit widths,
GPTQ's marlin / bitblas / ... formats, AWQ's gemv / exllama / marlin versions and
zero_point false, activation quantization
(W8A8, W4A8), sparsity, KV-cache schemes other than FP8 per tensor.

A compressed-tensors `kv_cache_scheme` of FP8 per tensor (`check_kv_cache_scheme`) is
accepted: its per-layer k_scale / v_scale tensors load with any checkpoint
(models/kv_scales.py) and scale an fp8 KV cache.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# quant_method -> what implements it.
IMPLEMENTED: dict[str, str] = {
    "fp8": "e4m3 weights with block, per-channel or per-tensor scales, dense and MoE "
           "(layers/linear_methods/fp8.py)",
    "gptq": "GPTQ 4 / 8-bit weights, dense and MoE (layers/linear_methods/gptq.py)",
    "awq": "AWQ 4-bit GEMM-layout weights, dense and MoE (layers/linear_methods/awq.py)",
    "compressed-tensors": "pack-quantized W4A16 / W8A16 weights, dense and MoE "
                          "(layers/linear_methods/compressed_tensors.py)",
}

# --quantization methods applied at load to an unquantized checkpoint
# (models/quantize_at_load.py).
QUANTIZE_AT_LOAD = ("int8", "fp8")

# The config keys transformers writes a checkpoint's quantization under.
CONFIG_KEYS = ("quantization_config", "compression_config")


def quantization_method(hf_config: dict, where: str = "checkpoint") -> tuple[str, str] | None:
    """(config key, quant_method) of a checkpoint's quantization, or None for none.

    Looked for at the top level and in a vision-language config's text_config (hub
    checkpoints put it in either place)."""
    for scope in (hf_config, hf_config.get("text_config") or {}):
        if not isinstance(scope, dict):
            continue
        for key in CONFIG_KEYS:
            qc = scope.get(key)
            if qc is None:
                continue
            if not isinstance(qc, dict):
                raise ValueError(f"{where}: {key} must be an object, got "
                                 f"{type(qc).__name__}")
            method = qc.get("quant_method")
            # compressed-tensors' older files name the method only by the key's presence.
            if method is None and key == "compression_config":
                method = "compressed-tensors"
            if not isinstance(method, str) or not method:
                raise ValueError(f"{where}: {key} has no quant_method: cannot tell how its "
                                 f"weights are stored")
            return key, method
    return None


def quantization_config(hf_config: dict) -> dict | None:
    """The checkpoint's quantization config object (top level or text_config), or None."""
    for scope in (hf_config, hf_config.get("text_config") or {}):
        if isinstance(scope, dict):
            for key in CONFIG_KEYS:
                if isinstance(scope.get(key), dict):
                    return scope[key]
    return None


@dataclass(frozen=True)
class Fp8Config:
    """A validated fp8 quantization_config: e4m3 weights with one fp32
    `weight_scale_inv` per [bn, bk] block, or (block_size None) a `weight_scale` per
    tensor or per output row; activations unquantized here whatever the scheme."""
    block_size: tuple[int, int] | None
    # modules_to_not_convert (transformers) / ignored_layers (vLLM) / ignore
    # (compressed-tensors, "re:" patterns too): checkpoint module names or suffixes
    # whose weights stay unquantized.
    ignored: tuple[str, ...] = ()
    # activation_scheme "static": the checkpoint has `input_scale` tensors (not used).
    static_activations: bool = False
    # The block scales' tensor: "weight_scale_inv" (quant_method fp8, DeepSeek-V3 /
    # Qwen -FP8) or "weight_scale" (compressed-tensors' block strategy). Both are the
    # dequantization factor: w = e4m3 * scale over the block.
    block_scale_name: str = "weight_scale_inv"

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint module `module` ("model.layers.0.mlp.down_proj") is
        one the config leaves unquantized: an entry equal to it, to a prefix of it at a
        module boundary ("model.layers.0" covers its projections), or to its tail
        ("lm_head", "mlp.gate"); with or without the "model." prefix."""
        return ignores_module(self.ignored, module)


def parse_fp8_config(qc: dict, where: str) -> Fp8Config:
    """Validate an fp8 quantization_config, or raise naming what is not implemented."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: fp8 fmt {fmt!r} is not implemented (tokenmill loads e4m3 "
                         f"fp8 weights only)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise ValueError(f"{where}: fp8 activation_scheme {scheme!r} is not implemented "
                         f"(dynamic or static; the activations stay unquantized either way)")
    block = qc.get("weight_block_size")
    if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                       for b in block)):
        raise ValueError(f"{where}: fp8 weight_block_size must be two positive ints "
                         f"[bn, bk], got {block!r}")
    ignored: list[str] = []
    for key in ("modules_to_not_convert", "ignored_layers"):
        names = qc.get(key) or []
        if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
            raise ValueError(f"{where}: fp8 {key} must be a list of module names, "
                             f"got {names!r}")
        ignored += names
    return Fp8Config(None if block is None else (block[0], block[1]), tuple(ignored),
                     scheme == "static")


def fp8_config(hf_config: dict, where: str = "checkpoint") -> Fp8Config | None:
    """The checkpoint's validated fp8 config, None when it is not quantized with fp8
    (quant_method "fp8", or compressed-tensors' "float-quantized" FP8)."""
    found = quantization_method(hf_config, where)
    if found is None:
        return None
    key, method = found
    if method.lower() == "compressed-tensors":
        qc = _ct_flat(quantization_config(hf_config))
        if qc.get("format") != "float-quantized":
            return None
        return parse_ct_fp8_config(qc, f"{where}: {key}.quant_method 'compressed-tensors'")
    if method.lower() != "fp8":
        return None
    return parse_fp8_config(quantization_config(hf_config), where)


def _ct_block_structure(w: dict, where: str) -> tuple[int, int]:
    """A block-strategy weights scheme's [bn, bk] (`block_structure`: a list of two
    positive ints, or older files' "NxM" string)."""
    block = w.get("block_structure")
    if isinstance(block, str) and "x" in block:
        parts = block.split("x")
        block = [int(p) for p in parts] if all(p.isdigit() for p in parts) else block
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0
                       for b in block)):
        raise ValueError(f"{where}: FP8 weights strategy 'block' needs block_structure "
                         f"[bn, bk] (two positive ints), got {block!r}")
    return block[0], block[1]


def _ct_fp8_scheme(group: dict, where: str) -> tuple[bool, tuple[int, int] | None]:
    """(whether one compressed-tensors FP8 config group quantizes its activations
    statically (an input_scale per layer), its weights' [bn, bk] blocks or None for
    per-tensor / per-channel scales), or refusal of what does not map onto the fp8
    method's e4m3 weights."""
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{where}: a config group has no weights scheme")
    if (w.get("type"), w.get("num_bits")) != ("float", 8):
        raise ValueError(f"{where}: float-quantized weights of type {w.get('type')!r} / "
                         f"num_bits {w.get('num_bits')!r} are not implemented (FP8: float, 8)")
    if w.get("strategy") not in ("tensor", "channel", "block"):
        raise ValueError(f"{where}: FP8 weights strategy {w.get('strategy')!r} is not "
                         f"implemented ('tensor', 'channel', 'block')")
    block = _ct_block_structure(w, where) if w.get("strategy") == "block" else None
    if w.get("dynamic", False):
        raise ValueError(f"{where}: dynamic FP8 weight scales are not implemented")
    if not w.get("symmetric", True):
        raise ValueError(f"{where}: asymmetric FP8 weights (a zero point) are not "
                         f"implemented")
    act = group.get("input_activations")
    if act is None:
        return False, block
    if (act.get("type"), act.get("num_bits")) != ("float", 8):
        raise ValueError(f"{where}: input_activations of type {act.get('type')!r} / num_bits "
                         f"{act.get('num_bits')!r} are not implemented (FP8 or none)")
    if group.get("output_activations") is not None:
        raise ValueError(f"{where}: output_activations is not implemented")
    return not act.get("dynamic", False), block


def check_kv_cache_scheme(scheme, where: str) -> None:
    """compressed-tensors' `kv_cache_scheme`: FP8 K/V with one static scale per layer
    and tensor (the checkpoint's k_scale / v_scale, models/kv_scales.py; used with
    --kv-cache-dtype fp8) is read; anything else is refused naming the field."""
    if not scheme:
        return
    if not isinstance(scheme, dict):
        raise ValueError(f"{where}: kv_cache_scheme must be an object, got {scheme!r}")
    want = {"type": "float", "num_bits": 8, "strategy": "tensor"}
    for key, value in want.items():
        got = scheme.get(key, "tensor" if key == "strategy" else None)
        if got != value:
            raise ValueError(f"{where}: kv_cache_scheme {key} {got!r} is not implemented "
                             f"(FP8 KV scales per tensor: type 'float', num_bits 8, "
                             f"strategy 'tensor')")
    if scheme.get("dynamic", False):
        raise ValueError(f"{where}: kv_cache_scheme dynamic is not implemented (static "
                         f"per-layer k_scale / v_scale only)")
    if not scheme.get("symmetric", True):
        raise ValueError(f"{where}: kv_cache_scheme symmetric false (a KV zero point) is "
                         f"not implemented")


def _ct_groups(qc: dict, where: str) -> dict[str, dict]:
    """A compressed-tensors config's config_groups (name -> group), after refusing what
    no tokenmill scheme reads: sparsity, KV-cache schemes other than FP8 per tensor,
    transforms."""
    sparsity = qc.get("sparsity_config")
    if sparsity and (sparsity.get("format") or "dense") != "dense":
        raise ValueError(f"{where}: sparsity_config format {sparsity.get('format')!r} "
                         f"(2:4 / bitmask sparsity) is not implemented")
    check_kv_cache_scheme(qc.get("kv_cache_scheme"), where)
    if qc.get("transform_config"):
        raise ValueError(f"{where}: transform_config is not implemented")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError(f"{where}: config_groups is empty or missing: no quantization "
                         f"scheme to load")
    return {n: g if isinstance(g, dict) else {} for n, g in groups.items()}


def parse_ct_fp8_config(qc: dict, where: str) -> Fp8Config:
    """compressed-tensors' float-quantized FP8 ("FP8" / "FP8-Dynamic" releases of
    llm-compressor: e4m3 `weight` with a `weight_scale` per tensor or per output row,
    activations per token dynamically or with a static `input_scale`; "FP8_BLOCK": a
    `weight_scale` [ceil(N / bn), ceil(K / bk)] per `block_structure` block) as the fp8
    method's per-tensor / per-channel or block config; the activations stay
    unquantized here (W8A16), as for quant_method "fp8"."""
    schemes = {_ct_fp8_scheme(g, f"{where}: config group {n!r}")
               for n, g in _ct_groups(qc, where).items()}
    if len({static for static, _ in schemes}) > 1:
        raise ValueError(f"{where}: config groups mixing static and dynamic activation "
                         f"scales are not implemented")
    if len({block for _, block in schemes}) > 1:
        raise ValueError(f"{where}: config groups with different FP8 weight strategies / "
                         f"block structures {sorted(str(b) for _, b in schemes)} are not "
                         f"implemented")
    static, block = schemes.pop()
    return Fp8Config(block, _names(qc, "ignore", where, "config"), static,
                     block_scale_name="weight_scale")


def check_quantization(hf_config: dict, where: str, implemented=None) -> str | None:
    """The checkpoint's quant_method when tokenmill implements it (and its config is one
    it loads: fp8's is validated), None when it is not quantized; raises ValueError
    naming the method otherwise. `where`: the checkpoint, for the message.
    `implemented`: the methods this loader takes (default IMPLEMENTED; a drafter's
    loader, which places no quantized layers, passes ())."""
    implemented = IMPLEMENTED if implemented is None else implemented
    found = quantization_method(hf_config, where)
    if found is None:
        return None
    key, method = found
    if method.lower() in implemented:
        fp8_config(hf_config, where)  # fp8's and compressed-tensors' FP8
        int_quant_config(hf_config, where)  # the integer formats' (below)
        return method.lower()
    implemented = ", ".join(sorted(implemented)) or "none (for this loader)"
    raise ValueError(
        f"{where}: {key}.quant_method {method!r} is not implemented; tokenmill loads "
        f"unquantized (bf16 / fp16 / fp32) checkpoints and these quantization methods: "
        f"{implemented}. Loading its weights without their scales would generate noise.")


# ---- integer formats: gptq, awq, compressed-tensors ------------------------------------

def _int_field(qc: dict, keys: tuple[str, ...], where: str, what: str, default=None):
    for key in keys:
        if key in qc:
            v = qc[key]
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{where}: {what} {key} must be an int, got {v!r}")
            return v
    if default is None:
        raise ValueError(f"{where}: {what} has no {keys[0]}")
    return default


def _group_size(v: int, where: str, what: str) -> int:
    if v != -1 and v <= 0:
        raise ValueError(f"{where}: {what} group_size must be positive or -1 (one group "
                         f"per row), got {v}")
    return v


def _names(qc: dict, key: str, where: str, what: str) -> tuple[str, ...]:
    names = qc.get(key) or []
    if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names):
        raise ValueError(f"{where}: {what} {key} must be a list of module names, got {names!r}")
    return tuple(names)


def ignores_module(entries: tuple[str, ...], module: str) -> bool:
    """Whether checkpoint module `module` is one of `entries`: a name equal to it, to a
    prefix of it at a module boundary or to its tail (with or without "model."), or a
    compressed-tensors "re:" pattern matching it."""
    name = module.removeprefix("model.")
    for e in entries:
        if e.startswith("re:"):
            if re.match(e[3:], module) or re.match(e[3:], name):
                return True
            continue
        e = e.removeprefix("model.")
        if name == e or name.startswith(e + ".") or name.endswith("." + e):
            return True
    return False


@dataclass(frozen=True)
class GptqConfig:
    """A validated gptq quantization_config (AutoGPTQ / GPTQModel)."""
    bits: int
    group_size: int             # -1: one group per row
    desc_act: bool
    sym: bool
    checkpoint_format: str      # "gptq" (v1: zeros stored minus one) | "gptq_v2"
    ignored: tuple[str, ...] = ()
    method = "gptq"

    @property
    def v1_zeros(self) -> bool:
        return self.checkpoint_format == "gptq"


def parse_gptq_config(qc: dict, where: str) -> GptqConfig:
    bits = _int_field(qc, ("bits",), where, "gptq")
    if bits not in (4, 8):
        raise ValueError(f"{where}: gptq bits {bits} is not implemented (tokenmill loads "
                         f"4- and 8-bit GPTQ)")
    group = _group_size(_int_field(qc, ("group_size",), where, "gptq", -1), where, "gptq")
    fmt = qc.get("checkpoint_format", qc.get("format", "gptq"))
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"{where}: gptq checkpoint_format {fmt!r} is not implemented "
                         f"(tokenmill loads 'gptq' and 'gptq_v2')")
    # lm_head true: the lm_head's tensors are quantized like a layer's (int_quant_layers
    # takes it where the checkpoint has them; tied to the embedding: refused there).
    if qc.get("dynamic"):
        raise ValueError(f"{where}: gptq dynamic (per-module bits / group overrides) is "
                         f"not implemented")
    pack = qc.get("pack_dtype", "int32")
    if pack not in ("int32", "torch.int32"):
        raise ValueError(f"{where}: gptq pack_dtype {pack!r} is not implemented (int32)")
    for key in ("desc_act", "sym"):
        if not isinstance(qc.get(key, False), bool):
            raise ValueError(f"{where}: gptq {key} must be true or false")
    return GptqConfig(bits, group, qc.get("desc_act", False), qc.get("sym", True), fmt,
                      _names(qc, "modules_to_not_convert", where, "gptq"))


@dataclass(frozen=True)
class AwqConfig:
    """A validated awq quantization_config (AutoAWQ, GEMM layout, zero points)."""
    group_size: int
    ignored: tuple[str, ...] = ()
    bits = 4
    method = "awq"


def parse_awq_config(qc: dict, where: str) -> AwqConfig:
    bits = _int_field(qc, ("bits", "w_bit"), where, "awq", 4)
    if bits != 4:
        raise ValueError(f"{where}: awq bits {bits} is not implemented (4-bit AWQ)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"{where}: awq version {version!r} is not implemented (tokenmill "
                         f"loads AWQ's 'gemm' layout)")
    backend = str(qc.get("backend", "autoawq")).lower()
    if backend not in ("autoawq", "auto_awq"):
        raise ValueError(f"{where}: awq backend {backend!r} is not implemented (AutoAWQ's "
                         f"layout)")
    if qc.get("zero_point", True) is not True:
        raise ValueError(f"{where}: awq zero_point false is not implemented (AutoAWQ's "
                         f"GEMM layout stores zero points)")
    group = _group_size(_int_field(qc, ("group_size", "q_group_size"), where, "awq", -1),
                        where, "awq")
    return AwqConfig(group, _names(qc, "modules_to_not_convert", where, "awq"))


@dataclass(frozen=True)
class CompressedTensorsConfig:
    """A validated compressed-tensors config: pack-quantized integer weights, one
    scheme for every quantized layer, activations unquantized."""
    bits: int
    group_size: int | None      # None: strategy "channel"
    symmetric: bool
    ignored: tuple[str, ...] = ()
    method = "compressed-tensors"


def _ct_weights(group: dict, where: str) -> tuple[int, int | None, bool]:
    """(bits, group_size or None, symmetric) of one config group, or refusal."""
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise ValueError(f"{where}: {key} (activation quantization: W8A8, W4A8, FP8 "
                             f"activations) is not implemented; tokenmill loads weight-only "
                             f"W4A16 / W8A16")
    fmt = group.get("format")
    if fmt not in (None, "pack-quantized"):
        raise ValueError(f"{where}: config group format {fmt!r} is not implemented "
                         f"(pack-quantized)")
    w = group.get("weights")
    if not isinstance(w, dict):
        raise ValueError(f"{where}: a config group has no weights scheme")
    if w.get("type", "int") != "int":
        raise ValueError(f"{where}: weights type {w.get('type')!r} (FP8 / FP4 weights) is "
                         f"not implemented; tokenmill loads int weights")
    bits = w.get("num_bits")
    if bits not in (4, 8):
        raise ValueError(f"{where}: weights num_bits {bits!r} is not implemented (4, 8)")
    if w.get("dynamic", False):
        raise ValueError(f"{where}: dynamic weight quantization is not implemented")
    strategy = w.get("strategy")
    if strategy == "channel":
        size = None
    elif strategy == "group":
        size = w.get("group_size")
        if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
            raise ValueError(f"{where}: strategy 'group' needs a positive group_size, got "
                             f"{size!r}")
    else:
        raise ValueError(f"{where}: weights strategy {strategy!r} is not implemented "
                         f"('group', 'channel')")
    sym = w.get("symmetric", True)
    if not isinstance(sym, bool):
        raise ValueError(f"{where}: weights symmetric must be true or false")
    return bits, size, sym


def _ct_flat(qc: dict) -> dict:
    """A compressed-tensors config with its nested quantization_config (older
    compression_config files) merged into the top level."""
    if "config_groups" not in qc and isinstance(qc.get("quantization_config"), dict):
        qc = {**qc["quantization_config"], **{k: v for k, v in qc.items()
                                             if k != "quantization_config"}}
    return qc


def parse_compressed_tensors_config(qc: dict, key: str, where: str) -> CompressedTensorsConfig:
    where = f"{where}: {key}.quant_method 'compressed-tensors'"
    qc = _ct_flat(qc)
    fmt = qc.get("format")
    if fmt != "pack-quantized":
        raise ValueError(f"{where}: format {fmt!r} is not implemented (tokenmill loads "
                         f"'pack-quantized' W4A16 / W8A16)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{where}: quantization_status {status!r} is not implemented "
                         f"(the weights are not stored packed)")
    schemes = {_ct_weights(g, f"{where}: config group {n!r}")
               for n, g in _ct_groups(qc, where).items()}
    if len(schemes) > 1:
        raise ValueError(f"{where}: config groups with different weight schemes "
                         f"{sorted(schemes, key=str)} are not implemented")
    bits, size, sym = schemes.pop()
    return CompressedTensorsConfig(bits, size, sym, _names(qc, "ignore", where, "config"))


def int_quant_config(hf_config: dict, where: str = "checkpoint"):
    """The checkpoint's validated integer-format config (GptqConfig, AwqConfig,
    CompressedTensorsConfig), None when it is not quantized with one of them."""
    found = quantization_method(hf_config, where)
    if found is None:
        return None
    key, method = found
    qc = quantization_config(hf_config)
    method = method.lower()
    if method == "gptq":
        return parse_gptq_config(qc, where)
    if method == "awq":
        return parse_awq_config(qc, where)
    if method == "compressed-tensors":
        if _ct_flat(qc).get("format") == "float-quantized":
            return None  # FP8: fp8_config's
        return parse_compressed_tensors_config(qc, key, where)
    return None
