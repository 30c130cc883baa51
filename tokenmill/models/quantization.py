"""Which quantized checkpoint formats the engine loads, decided before any weight is read.

A quantized checkpoint stores packed or low-precision weights beside scale tensors. Read
as if it were a bf16 one, its values land in the parameters without their scales and the
model generates noise that looks like output. So a `quantization_config` (or the older
`compression_config` of compressed-tensors) is refused by name unless its method is in
IMPLEMENTED; a format gains an entry here together with its linear method and kernels.

Implemented: "fp8" with block scales (DeepSeek-V3 / Qwen -FP8: e4m3 weights, dynamic
activations, `weight_block_size` [bn, bk], `weight_scale_inv` per block), for the dense
Linear layers (`parse_fp8_config` validates the config here; models/quantized_layers.py
gives the layers the checkpoint quantizes their method before the weights load). Each
variant of it not implemented is refused by name: e5m2, static activation scales,
per-tensor scales (no weight_block_size).
"""
from __future__ import annotations

from dataclasses import dataclass

# quant_method -> what implements it.
IMPLEMENTED: dict[str, str] = {
    "fp8": "block-scaled e4m3 weights of dense layers (layers/linear_methods/fp8.py)",
}

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
    """A validated fp8 quantization_config: e4m3 weights, one fp32 `weight_scale_inv`
    per [bn, bk] block, dynamic (here: unquantized) activations."""
    block_size: tuple[int, int]
    # modules_to_not_convert (transformers) / ignored_layers (vLLM): checkpoint module
    # names or suffixes whose weights stay unquantized.
    ignored: tuple[str, ...] = ()

    def ignores(self, module: str) -> bool:
        """Whether the checkpoint module `module` ("model.layers.0.mlp.down_proj") is
        one the config leaves unquantized: an entry equal to it, to a prefix of it at a
        module boundary ("model.layers.0" covers its projections), or to its tail
        ("lm_head", "mlp.gate"); with or without the "model." prefix."""
        name = module.removeprefix("model.")
        return any(name == e or name.startswith(e + ".") or name.endswith("." + e)
                   for e in (e.removeprefix("model.") for e in self.ignored))


def parse_fp8_config(qc: dict, where: str) -> Fp8Config:
    """Validate an fp8 quantization_config, or raise naming what is not implemented."""
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"{where}: fp8 fmt {fmt!r} is not implemented (tokenmill loads e4m3 "
                         f"fp8 weights with block scales only)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(f"{where}: fp8 activation_scheme {scheme!r} is not implemented: its "
                         f"static activation scales (input_scale) are not read; tokenmill "
                         f"loads fp8 checkpoints with activation_scheme 'dynamic'")
    block = qc.get("weight_block_size")
    if block is None:
        raise ValueError(f"{where}: fp8 without weight_block_size (one weight_scale per "
                         f"tensor) is not implemented; tokenmill loads block-scaled fp8 "
                         f"(weight_block_size [bn, bk], weight_scale_inv per block)")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
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
    return Fp8Config((block[0], block[1]), tuple(ignored))


def fp8_config(hf_config: dict, where: str = "checkpoint") -> Fp8Config | None:
    """The checkpoint's validated fp8 config, None when it is not quantized with fp8."""
    found = quantization_method(hf_config, where)
    if found is None or found[1].lower() != "fp8":
        return None
    return parse_fp8_config(quantization_config(hf_config), where)


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
        if method.lower() == "fp8":
            fp8_config(hf_config, where)
        return method.lower()
    implemented = ", ".join(sorted(implemented)) or "none (for this loader)"
    raise ValueError(
        f"{where}: {key}.quant_method {method!r} is not implemented; tokenmill loads "
        f"unquantized (bf16 / fp16 / fp32) checkpoints and these quantization methods: "
        f"{implemented}. Loading its weights without their scales would generate noise.")
