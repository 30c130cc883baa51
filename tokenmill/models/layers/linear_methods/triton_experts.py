"""The CUDA path shared by the quantized experts' methods (QuantizedFusedMoEMethod,
Int8AtLoadFusedMoEMethod, Fp8BlockFusedMoEMethod): the platform asks for it with
`with_triton`; when the layer sets that method, the method's own
process_weights_after_loading moves the experts into ops/triton_quant_moe.py's device
layout (`gpu` = (w13, w2): the experts' only copy from then on) and `apply` runs its
grouped GEMMs, which read no device value on the host (CUDA graphs, async
scheduling)."""
from __future__ import annotations

import copy


class TritonExpertsMixin:
    triton = False  # set by with_triton: move the experts when the layer sets the method
    gpu = None      # (w13, w2) as triton_quant_moe's IntExpertsTriton / Fp8ExpertsTriton

    TRITON_DESCRIPTION = ", Triton grouped GEMMs (no host sync)"

    def with_triton(self):
        """This method running the Triton grouped GEMMs (CUDA)."""
        method = copy.copy(self)
        method.triton = True
        return method

    def apply_triton(self, layer, x, topk_weights, topk_ids):
        from tokenmill.ops.triton_quant_moe import fused_experts_triton
        return fused_experts_triton(x, *self.gpu, topk_weights, topk_ids, self.compute_dtype,
                                    layer.activation)

    def triton_nbytes(self) -> int:
        """Resident bytes of the experts in the Triton layout."""
        return sum(w.nbytes() for w in self.gpu)
