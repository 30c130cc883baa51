"""The Triton backend (CUDA): tokenmill/ops/triton_attention.py over the same paged cache.

`write_kv` scatters K/V through the flat slot mapping (block id * block_size + offset;
-1, a CUDA-graph pad row, is skipped), `paged_decode` runs every decode row in one
launch (GQA, window, soft-cap, pad rows of seq_len 0, split-K for few rows) and
`paged_prefill` every prompt chunk in one launch over its cached prefix. Its builder
adds the flat fields those kernels read (slot_mapping; the chunks' query_start_loc,
seq_lens and block table, builder.PromptBatchBuilder's) to the base builder's. Any
head size up to TRITON_MAX_HEAD_SIZE (a power-of-two block, its tail masked); a
larger head takes the PyTorch reference. Decode steps read only fixed-shape metadata, so they may be
replayed from CUDA graphs. triton is imported when a layer is bound to the kernels,
never by importing this module: a CPU-only install has no triton.
"""
from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, AttentionImpl, is_paged_kv
from tokenmill.attention.builder import PromptBatchBuilder
from tokenmill.attention.metadata import AttentionMetadata

# ops/triton_attention.MAX_HEAD_SIZE (not imported: that module imports triton).
TRITON_MAX_HEAD_SIZE = 512


class TritonMetadataBuilder(PromptBatchBuilder):
    def _fill_slots(self, meta, block_ids, offsets, block_size) -> None:
        meta.slot_mapping = self._tensor(block_ids * block_size + offsets)


class TritonAttentionImpl(AttentionImpl):
    def __init__(self, layer):
        super().__init__(layer)
        from tokenmill.ops import triton_attention
        self.ops = triton_attention

    def write_kv(self, k, v, cache, meta: AttentionMetadata) -> None:
        self.ops.write_kv(k, v, cache, meta.slot_mapping, self.k_scale, self.v_scale)

    def forward(self, q, k, v, cache, meta: AttentionMetadata) -> torch.Tensor:
        """One decode launch over the decode rows, one prefill launch over every prompt
        chunk (their K/V are in the cache already)."""
        ops, nd, window = self.ops, meta.num_decodes, self.sliding_window or 0
        cap = self.logit_softcap or 0.0
        kv_scales = dict(k_scale=self.k_scale, v_scale=self.v_scale)
        if not meta.prefills:
            return ops.paged_decode(q, cache, meta.decode_block_table, meta.decode_seq_lens,
                                    self.scale, window, softcap=cap, **kv_scales)
        out = torch.empty_like(q)
        if nd:
            ops.paged_decode(q[:nd], cache, meta.decode_block_table, meta.decode_seq_lens,
                             self.scale, window, out=out[:nd], softcap=cap, **kv_scales)
        ops.paged_prefill(q[nd:], cache, meta.prefill_block_table, meta.prefill_query_start_loc,
                          meta.prefill_seq_lens, meta.prefill_max_query_len, self.scale, window,
                          out=out[nd:], softcap=cap, **kv_scales)
        return out


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    impl_class = TritonAttentionImpl
    builder_class = TritonMetadataBuilder
    cuda_graphs = True

    def supports(self, spec) -> bool:
        return is_paged_kv(spec) and 0 < spec.head_size <= TRITON_MAX_HEAD_SIZE
