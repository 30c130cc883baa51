"""How the GEMM layers keep and multiply their weights: one method per layer, chosen by
the platform once after loading (tokenmill/platforms/interface.py `linear_method` /
`moe_method`); the layers (`layers/linear.py` Linear, `layers/moe.py` FusedMoE) only
call it.

- base.py: the interfaces, `LinearMethod` and `FusedMoEMethod`;
- unquantized.py: `UnquantizedLinearMethod` (F.linear, in the model's dtype or
  widened) and `OneDNNPrepackedLinearMethod`;
- cpu_packed.py: `PackedBf16LinearMethod` and `PackedF32LinearMethod`, the native
  CPU kernels' packed layouts for decode-sized inputs, each over a fallback method;
- fused_moe.py: the grouped expert GEMMs and `UnquantizedFusedMoEMethod`,
  `SyncFreeFusedMoEMethod` (CUDA), `PackedBf16FusedMoEMethod` (CPU);
- fp8.py: `Fp8BlockLinearMethod` and `Fp8BlockFusedMoEMethod` (stacked experts),
  block-scaled e4m3 weights (FP8 checkpoints as published), given to a layer before
  loading (models/quantized_layers.py);
- the integer formats (GPTQ, AWQ, compressed-tensors): int_layout.py's
  `IntLinearMethod` over a format's layout (gptq.py, awq.py, compressed_tensors.py;
  packing in int_packing.py), `QuantizedFusedMoEMethod` (quantized_moe.py) for the
  experts, all converting into quantized_weight.py's canonical form; given before
  loading by models/int_quant_layers.py;
- triton_experts.py: `TritonExpertsMixin`, the quantized experts' CUDA path
  (ops/triton_quant_moe.py's grouped GEMMs), shared by their three methods.

A quantized format plugs in as another method pair: its `create_weights` registers
what its checkpoint holds (packed integers, scales), its `apply` runs its kernel.
"""
from tokenmill.models.layers.linear_methods.base import ALL_ROWS, FusedMoEMethod, LinearMethod
from tokenmill.models.layers.linear_methods.cpu_packed import (PackedBf16LinearMethod,
                                                               PackedF32LinearMethod)
from tokenmill.models.layers.linear_methods.fp8 import (Fp8BlockFusedMoEMethod,
                                                        Fp8BlockLinearMethod)
from tokenmill.models.layers.linear_methods.fused_moe import (PackedBf16FusedMoEMethod,
                                                              SyncFreeFusedMoEMethod,
                                                              UnquantizedFusedMoEMethod)
from tokenmill.models.layers.linear_methods.unquantized import (OneDNNPrepackedLinearMethod,
                                                                UnquantizedLinearMethod)

__all__ = ["ALL_ROWS", "LinearMethod", "FusedMoEMethod", "UnquantizedLinearMethod",
           "OneDNNPrepackedLinearMethod", "PackedBf16LinearMethod", "PackedF32LinearMethod",
           "UnquantizedFusedMoEMethod", "SyncFreeFusedMoEMethod", "PackedBf16FusedMoEMethod",
           "Fp8BlockLinearMethod", "Fp8BlockFusedMoEMethod", "widen_gemms"]


def widen_gemms(model, dtype) -> int:
    """Give every GEMM layer of `model` still on the plain unquantized method, whose
    weights are not in `dtype`, the widened one (its GEMMs computed in `dtype`);
    returns how many. What a platform that widens chooses for such layers (without
    its packed kernels), for code that builds layers without a platform (tests)."""
    changed = 0
    for module in model.modules():
        method = getattr(module, "method", None)
        if type(method) is UnquantizedLinearMethod and method.compute_dtype is None:
            weight, widened = module.weight, UnquantizedLinearMethod(dtype)
        elif type(method) is UnquantizedFusedMoEMethod and method.compute_dtype is None:
            weight, widened = module.gate_up_proj, UnquantizedFusedMoEMethod(dtype)
        else:
            continue
        if weight.dtype != dtype:
            module.set_method(widened)
            changed += 1
    return changed
