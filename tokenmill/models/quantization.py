"""Which quantized checkpoint formats the engine loads, decided before any weight is read.

A quantized checkpoint stores packed or low-precision weights beside scale tensors. Read
as if it were a bf16 one, its values land in the parameters without their scales and the
model generates noise that looks like output. So a `quantization_config` (or the older
`compression_config` of compressed-tensors) is refused by name unless its method is in
IMPLEMENTED; a format gains an entry here together with its linear method and kernels.
"""
from __future__ import annotations

# quant_method -> what implements it. Empty: every quantized format is refused for now.
IMPLEMENTED: dict[str, str] = {}

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


def check_quantization(hf_config: dict, where: str) -> str | None:
    """The checkpoint's quant_method when tokenmill implements it, None when it is not
    quantized; raises ValueError naming the method otherwise. `where`: the checkpoint,
    for the message."""
    found = quantization_method(hf_config, where)
    if found is None:
        return None
    key, method = found
    if method.lower() in IMPLEMENTED:
        return method.lower()
    implemented = ", ".join(sorted(IMPLEMENTED)) or "none yet"
    raise ValueError(
        f"{where}: {key}.quant_method {method!r} is not implemented; tokenmill loads "
        f"unquantized (bf16 / fp16 / fp32) checkpoints and these quantization methods: "
        f"{implemented}. Loading its weights without their scales would generate noise.")
