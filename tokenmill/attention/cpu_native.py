"""The CPU native backend: tokenmill.kernels' paged attention kernels.

K/V go into the cache through `kv_cache_write` (kernels/cpu_fused.cpp), decode rows
attend through `paged_decode` (kernels/cpu_paged_attention.cpp: any head size, GQA, a
sliding window started at its first position, soft-capped scores), one call for all
decode rows, and every prompt chunk of the step through one `paged_prefill`
(kernels/cpu_paged_prefill.cpp: flash-style tiles over the chunk's cached prefix and
its own K/V, read from the cache blocks; the same masks and caps). The builder adds
the chunks' flat fields (builder.PromptBatchBuilder). An fp8 (float8_e4m3fn) cache is
written and read by the same kernels: the write divides by the layer's k_scale /
v_scale, rounds and saturates, the reads widen in registers (kernels/vec_fp8.h); the
decode multiplies the scales back (k_scale folded into the query scale, v_scale into
the output). Prompt chunks over an fp8 cache take the PyTorch reference's SDPA
(torch_ref.py) for now (see forward: the end-to-end fp8 tests, and KV scales).
"""
from __future__ import annotations

import torch

from tokenmill.attention.backend import is_paged_kv
from tokenmill.attention.builder import PromptBatchBuilder
from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.attention.torch_ref import TorchAttentionBackend, TorchAttentionImpl


def prompt_batch(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query_start_loc int64, seq_lens int32, block_table int32) of the step's prompt
    chunks: the builder's, or (metadata made by hand) made once from `meta.prefills`."""
    if meta.prefill_query_start_loc is None:
        chunks, first = meta.prefills, meta.prefills[0].query_start
        width = max(c.block_table.numel() for c in chunks)
        table = torch.zeros(len(chunks), width, dtype=torch.int32)
        for i, c in enumerate(chunks):
            table[i, :c.block_table.numel()] = c.block_table
        meta.prefill_query_start_loc = torch.tensor(
            [c.query_start - first for c in chunks] + [chunks[-1].query_end - first])
        meta.prefill_seq_lens = torch.tensor(
            [c.context_len + c.query_end - c.query_start for c in chunks], dtype=torch.int32)
        meta.prefill_block_table = table
    return meta.prefill_query_start_loc, meta.prefill_seq_lens, meta.prefill_block_table


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

    def forward(self, q, k, v, cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: one call, no output copy
            return self.decode(q, cache, meta)
        # The kernels read a cache of the queries' dtype or fp8 only; a cache of another
        # dtype (K/V written through the reference's cast) takes the reference's SDPA.
        if q.dtype != cache.dtype and cache.dtype != torch.float8_e4m3fn:
            return super().forward(q, k, v, cache, meta)
        # An fp8 cache's prompt chunks stay on the reference's SDPA for now: the kernel
        # reads fp8 exactly (tests/unit/test_paged_prefill_kernel.py), but its fp32 order
        # moves a later layer's K/V across an e4m3 rounding boundary now and then (gemma3
        # in tests/models/test_kv_cache_fp8.py: one byte in two layers, one e4m3 step),
        # and the end-to-end fp8 tests pin SDPA's order against HF's emulation. SDPA also
        # multiplies back checkpoint k_scale / v_scale, which paged_prefill does not take.
        if cache.dtype == torch.float8_e4m3fn:
            return super().forward(q, k, v, cache, meta)
        qsl, seq_lens, table = prompt_batch(meta)
        chunks = self.ops.paged_prefill(q[nd:], cache, table, qsl, seq_lens, self.scale,
                                        self.sliding_window or 0, self.logit_softcap or 0.0)
        if not nd:
            return chunks
        return torch.cat([self.decode(q[:nd], cache, meta), chunks])

    def decode(self, q, cache, meta: AttentionMetadata) -> torch.Tensor:
        return self.ops.paged_decode(q.contiguous(), cache, meta.decode_block_table,
                                     meta.decode_seq_lens, self.scale,
                                     self.sliding_window or 0, self.logit_softcap or 0.0,
                                     self.k_scale, self.v_scale)


class CpuNativeAttentionBackend(TorchAttentionBackend):
    name = "cpu_native"
    impl_class = CpuNativeAttentionImpl
    builder_class = PromptBatchBuilder

    def __init__(self, ops):
        self.ops = ops

    def supports(self, spec) -> bool:
        return self.ops is not None and is_paged_kv(spec)

    def make_impl(self, layer) -> CpuNativeAttentionImpl:
        return self.impl_class(layer, self.ops)
