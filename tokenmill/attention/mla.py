"""MLA backends: the latent-space attention of the absorbed decode (layers/mla.py).

The layer folds q_nope through W_UK into the latent space (qa = [q_lat | q_pe], one
row per head) and takes the result through W_UV afterwards; a backend runs what lies
between, each decode row's heads over its latent rows, and writes the step's latents.

- `TorchMLABackend`: the rows' latent blocks gathered, one batched matmul pair
  (padded tails masked); the reference the kernel is tested against, and what every
  platform without a latent kernel runs;
- `CpuNativeMLABackend`: `mla_decode` (kernels/cpu_mla_decode.cpp): per row it walks
  the block table's latent rows once for all heads (online softmax over 32-token
  tiles) and splits long rows across threads; a cache whose dtype differs from q's
  takes the batched matmuls.
"""
from __future__ import annotations

import torch

from tokenmill.attention.backend import AttentionBackend, MLAImpl, is_mla
from tokenmill.attention.metadata import AttentionMetadata


class TorchMLAImpl(MLAImpl):
    def decode(self, qa, cache, meta: AttentionMetadata) -> torch.Tensor:
        nd, r = qa.shape[0], self.kv_lora_rank
        latents = cache[meta.decode_block_table.long()].view(nd, -1, self.head_size)
        scores = torch.bmm(qa, latents.transpose(1, 2)).float() * self.scale
        scores = scores + meta.decode_mask(cache.shape[1])[:, 0]  # [nd, 1, L]
        probs = scores.softmax(dim=-1).to(latents.dtype)
        return torch.bmm(probs, latents[..., :r])  # [nd, H, r]


class CpuNativeMLAImpl(TorchMLAImpl):
    def __init__(self, layer, ops):
        super().__init__(layer)
        self.ops = ops

    def decode(self, qa, cache, meta: AttentionMetadata) -> torch.Tensor:
        if cache.dtype != qa.dtype:  # the kernel reads both in one dtype
            return super().decode(qa, cache, meta)
        return self.ops.mla_decode(qa, cache, meta.decode_block_table, meta.decode_seq_lens,
                                   self.scale, self.kv_lora_rank)


class TorchMLABackend(AttentionBackend):
    name = "mla_torch"
    impl_class = TorchMLAImpl

    def supports(self, spec) -> bool:
        return is_mla(spec)


class CpuNativeMLABackend(TorchMLABackend):
    name = "mla_cpu_native"
    impl_class = CpuNativeMLAImpl

    def __init__(self, ops):
        self.ops = ops

    def supports(self, spec) -> bool:
        return self.ops is not None and is_mla(spec)

    def make_impl(self, layer) -> CpuNativeMLAImpl:
        return self.impl_class(layer, self.ops)
