"""The CPU native backend: tokenmill.kernels' paged attention kernels.

K/V go into the cache through `kv_cache_write` (kernels/cpu_fused.cpp) and decode rows
attend through `paged_decode` (kernels/cpu_paged_attention.cpp: any head size, GQA, a
sliding window started at its first position, soft-capped scores), one call for all
decode rows. Prompt chunks take the PyTorch reference's SDPA path (torch_ref.py),
whose GEMMs are oneDNN's already. An fp8 (float8_e4m3fn) cache is written and read
by the same two kernels: the write divides by the layer's k_scale / v_scale, rounds
and saturates, the decode widens in registers (kernels/vec_fp8.h) and multiplies the
scales back (k_scale folded into the query scale, v_scale into the output).
"""
from __future__ import annotations

import torch

from tokenmill.attention.backend import is_paged_kv
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchAttentionBackend, TorchAttentionImpl


class CpuNativeAttentionImpl(TorchAttentionImpl):
    def __init__(self, layer, ops):
        super().__init__(layer)
        self.ops = ops  # the platform's kernels module (tokenmill.kernels.cpu_ops())

    def write_kv(self, k, v, cache, meta: AttentionMetadata) -> None:
        # The kernel copies bytes (no cast inside it) except into an fp8 cache.
        if k.dtype != cache.dtype and cache.dtype != torch.float8_e4m3fn:
            return super().write_kv(k, v, cache, meta)
        self.ops.kv_cache_write(cache, k, v, meta.slot_block, meta.slot_offset,
                                self.k_scale, self.v_scale)

    def decode(self, q, cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_decode(q.contiguous(), cache, meta.decode_block_table,
                                     meta.decode_seq_lens, self.scale,
                                     self.sliding_window or 0, self.logit_softcap or 0.0,
                                     self.k_scale, self.v_scale)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu_native"
    impl_class = CpuNativeAttentionImpl

    def __init__(self, ops):
        self.ops = ops

    def supports(self, spec) -> bool:
        return self.ops is not None and is_paged_kv(spec)

    def make_impl(self, layer) -> CpuNativeAttentionImpl:
        return self.impl_class(layer, self.ops)
