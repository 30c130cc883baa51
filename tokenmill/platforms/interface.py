"""What every platform decides: the interface the engine, the runner and the loaders read.

A platform is made once per engine, from the engine's arguments and the device
(`tokenmill.platforms.create_platform`), and passed down to whatever builds or runs
the model; nothing builds one of its own. Each field is one kernel decision, made
for the whole run; `prepare_model` hands them to the layers once, after the weights
are loaded. The fields every platform answers are here, each with what it means on
a platform that has no such kernel; a platform's own facts (the CPU's capability
level, CUDA's `enforce_eager`) are fields of that platform only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class Platform:
    device: str                     # torch device string ("cpu", "cuda", "cuda:1", "meta")
    model_dtype: str                # the checkpoint's compute dtype (activations, KV cache)
    gemm_dtype: str                 # what the GEMMs compute in (wider where bf16 is emulated)
    # Attention kernels: "native" (the CPU kernels), "triton" (CUDA) or "torch" (the
    # PyTorch reference path, every device).
    attention: str = "torch"
    # Dense layers: the decode-sized inputs' kernel ("packed_bf16", "packed_f32" or
    # "torch"), how many rows take it, and the GEMM of the other inputs.
    linear: str = "torch"
    linear_bf16_max_rows: int = 0   # rows that take packed_bf16 (layers/linear.py ALL_ROWS: all)
    linear_f32_max_rows: int = 0    # rows that take packed_f32 (0: never)
    gemm: str = "torch"             # "onednn_prepacked" or "torch"
    weights: str = ""               # what the Linear layers keep in memory (for the log)
    norm: str = "torch"             # RMSNorm of half-precision activations: "native" / "torch"
    activation: str = "torch"       # silu_mul / gelu_tanh_mul: "native" / "torch"
    lm_head: str = "full"           # "greedy_int8" (int8-screened argmax) or "full"
    greedy_head_max_rows: int = 0   # rows that take greedy_int8 (0: never)
    decode_layers: bool = False     # a decode step's layers in one native call
    linear_attention: str = "torch"  # Gated DeltaNet kernels: "fla" or "torch"
    cuda_graphs: bool = False       # decode steps replayed from captured graphs
    # Ranks the model is sharded over: above 1 the native decode loop and the greedy
    # head are off (neither can all-reduce or gather inside its native call).
    tensor_parallel_size: int = 1
    # The native CPU kernels module the decisions above use, or None.
    ops: object = field(default=None, compare=False, repr=False)

    @property
    def widen_to(self):
        """The torch dtype the GEMM layers are widened to, or None (they keep the model's)."""
        import torch
        return None if self.gemm_dtype == self.model_dtype else getattr(torch, self.gemm_dtype)

    @property
    def fast_decode_rows(self) -> int | None:
        """Rows a decode step may have at about the cost of one (speculative decoding's
        row budget); None: no such limit."""
        return None

    def in_this_process(self) -> Platform:
        """The same decisions, usable in this process (a tensor-parallel worker gets the
        engine's platform pickled: a kernels module is loaded again there)."""
        return self

    def describe(self) -> str:
        """One line for the start-up log: what will run."""
        raise NotImplementedError

    def as_dict(self) -> dict:
        """Every decision and what it was made from (JSON-ready; no kernels module)."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "ops"}
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in out.items()}
        out["platform"] = type(self).__name__
        out["description"] = self.describe()
        return out

    def prepare_model(self, model) -> None:
        """After the weights are loaded: hand the decisions to the layers (packed and
        prepacked weights, widened GEMMs, each layer's kernels module, the decode loop).
        Nothing is decided per forward call afterwards."""
        import torch

        from tokenmill.models.layers.linear import Linear, widen_gemms
        from tokenmill.models.layers.moe import FusedMoE
        if self.linear == "packed_bf16":
            for module in model.modules():
                weight = (module.weight if isinstance(module, Linear) else
                          module.gate_up_proj if isinstance(module, FusedMoE) else None)
                if (weight is not None and weight.dtype == torch.bfloat16
                        and weight.device.type == "cpu"):
                    module.pack_bf16(self.ops, self.linear_bf16_max_rows)
        elif self.linear == "packed_f32":
            for module in model.modules():
                if (isinstance(module, Linear) and module.weight.dtype == torch.float32
                        and module.weight.device.type == "cpu"):
                    module.pack_f32(self.ops, self.linear_f32_max_rows)
        if self.gemm == "onednn_prepacked":
            dtype = getattr(torch, self.model_dtype)
            # Parameters more than one module holds (a head tied to the embedding).
            seen: dict[int, int] = {}
            for _, p in model.named_parameters(remove_duplicate=False):
                seen[id(p)] = seen.get(id(p), 0) + 1
            for module in model.modules():
                if (isinstance(module, Linear) and module.weight.dtype == dtype
                        and module.weight.device.type == "cpu" and not module.packed_only
                        and not module.weight.is_meta):
                    module.prepack_onednn(keep_weight=seen.get(id(module.weight), 0) > 1)
        widen = self.widen_to
        if widen is not None:
            n = widen_gemms(model, widen)  # packed-only layers keep their bf16 weights
            if n:
                logger.info("%d GEMM layers compute in %s (activations and KV cache stay %s)",
                            n, self.gemm_dtype, self.model_dtype)
        norm_ops = self.ops if self.norm == "native" else None
        act_ops = self.ops if self.activation == "native" else None
        for module in model.modules():
            if hasattr(module, "set_norm_kernels"):
                module.set_norm_kernels(norm_ops)
            if hasattr(module, "set_activation_kernels"):
                module.set_activation_kernels(act_ops)
        set_decode_layers = getattr(model, "set_decode_layers", None)
        if set_decode_layers is not None:
            set_decode_layers(self.ops if self.decode_layers else None,
                              self.linear_f32_max_rows if self.linear == "packed_f32"
                              else self.linear_bf16_max_rows)


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")
