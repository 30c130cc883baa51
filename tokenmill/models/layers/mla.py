"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged latent cache.

The cache of one layer is a [num_blocks, block_size, kv_lora_rank + rope_dim]
view (MLAAttentionSpec): per token one latent row, [normed compressed kv |
roped k_pe], shared by every head. Head h's key is [W_UK[h] c | k_pe] and its
value W_UV[h] c, where c is the compressed kv and kv_b_proj = [W_UK; W_UV] per
head.

* Prompt chunks run the naive form: the chunk's keys and values (its context's
  too, gathered through the block table) are expanded per head with one
  kv_b_proj GEMM, then scaled_dot_product_attention as for any other layer.
  A chunk has many queries per key, so expanding once is the cheaper side.
* Decode rows run the weight-absorbed form: q_nope is folded through W_UK into
  the latent space (q_lat[h] = W_UK[h]^T q_nope[h]), each head attends over the
  latent rows directly (scores = [q_lat | q_pe] . latent), the latent output is
  taken through W_UV afterwards. Nothing per head is expanded, so a step reads
  each cached token's kv_lora_rank + rope_dim values once for all heads: one
  batched matmul pair over the rows' gathered blocks.

The latent-space attention between those projections is the layer's `impl`, bound
by the runner from its group's MLA backend (tokenmill/attention/mla.py): the native
`mla_decode` kernel (kernels/cpu_mla_decode.cpp: per row it walks the block table's
latent rows once for all heads) or the batched matmuls over gathered blocks (every
other platform, and the reference the kernel is tested against). The paged decode
kernel's MQA route (one KV head of width kv_lora_rank + rope_dim) was dropped: it
computed each head on its own, re-reading every latent row once per head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.backend import MLAImpl
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk


class PagedMLAAttention(nn.Module):
    # The runner's view of a paged layer: full attention over one latent "head"; it
    # reports an MLAAttentionSpec of (kv_lora_rank, rope_dim) for a `latent_cache` layer.
    latent_cache = True
    sliding_window = None
    num_kv_heads = 1
    # False: decode rows take the naive form too (K/V expanded per head from the whole
    # latent context every step): what the absorption saves (`tokenmill bench window`).
    absorb_decode = True

    def __init__(self, num_heads: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, kv_lora_rank: int, scale: float):
        super().__init__()
        self.num_heads = num_heads
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.kv_lora_rank = kv_lora_rank
        self.head_size = kv_lora_rank + qk_rope_head_dim
        self.scale = scale
        # Bound by the runner: the cache, its KV cache group, the backend's implementation.
        self.kv_cache: torch.Tensor | None = None
        self.kv_group: int | None = None
        self.impl: MLAImpl | None = None
        # (W_UK [H, nope, r], W_UV [H, r, v]) from kv_b_proj, built at the first decode.
        self._absorbed: tuple[torch.Tensor, torch.Tensor] | None = None

    def write_latent(self, latent: torch.Tensor, meta: AttentionMetadata) -> None:
        """latent [T, kv_lora_rank + rope_dim] into the paged cache at the step's slots."""
        self.impl.write_kv(latent, self.kv_cache, meta.for_group(self.kv_group))

    def forward(self, q: torch.Tensor, latent: torch.Tensor, kv_b_proj: nn.Module,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, H, nope + rope] (q_pe roped), latent [T, kv_lora_rank + rope] (the normed
        compressed kv, then the roped k_pe) -> [T, H * v_head_dim]."""
        meta = meta.for_group(self.kv_group)
        cache = self.kv_cache
        self.write_latent(latent, meta)
        t, nd = q.shape[0], meta.num_decodes
        if not meta.prefills:
            return self._decode(q, cache, meta, kv_b_proj).reshape(t, -1)
        out = q.new_empty(t, self.num_heads, self.v_dim)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta, kv_b_proj)
        for p in meta.prefills:
            s, e = p.query_start, p.query_end
            out[s:e] = self._prefill(q[s:e], latent[s:e], cache, p, kv_b_proj)
        return out.view(t, -1)

    # ---- decode: the absorbed form -------------------------------------------------
    def absorbed_weights(self, kv_b_proj: nn.Module,
                         dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's K part as [H, nope, r] and its V part as [H, r, v], in `dtype`."""
        if self._absorbed is None or self._absorbed[0].dtype != dtype:
            w = kv_b_proj.dense_weight() if hasattr(kv_b_proj, "dense_weight") \
                else kv_b_proj.weight.detach()
            w = w.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank).to(dtype)
            self._absorbed = (w[:, :self.nope].contiguous(),
                              w[:, self.nope:].transpose(1, 2).contiguous())
        return self._absorbed

    def _decode(self, q, cache, meta: AttentionMetadata, kv_b_proj) -> torch.Tensor:
        """Absorbed decode of the first nd rows (one query token each) -> [nd, H, v]."""
        if not self.absorb_decode:
            return self._decode_naive(q, cache, meta, kv_b_proj)
        w_uk, w_uv = self.absorbed_weights(kv_b_proj, q.dtype)
        q_lat = torch.bmm(q[..., :self.nope].transpose(0, 1), w_uk)  # [H, nd, r]
        qa = torch.cat([q_lat.transpose(0, 1), q[..., self.nope:]], dim=-1)  # [nd, H, r + rope]
        o = self.impl.decode(qa, cache, meta)  # [nd, H, r]
        return torch.bmm(o.transpose(0, 1), w_uv).transpose(0, 1)  # [nd, H, v]

    def _decode_naive(self, q, cache, meta: AttentionMetadata, kv_b_proj) -> torch.Tensor:
        """Decode rows as one-token prompt chunks over their whole context (a comparison
        path: a loop over rows, each expanding its K/V per head)."""
        lens = meta.decode_seq_lens.tolist()
        bs = cache.shape[1]
        out = []
        for i, n in enumerate(lens):
            chunk = PrefillChunk(i, i + 1, n - 1, meta.decode_block_table[i, :-(-n // bs)])
            out.append(self._prefill(q[i:i + 1], None, cache, chunk, kv_b_proj))
        return torch.cat(out)

    # ---- prompt chunks: the naive form ---------------------------------------------
    def _prefill(self, q, latent, cache, p: PrefillChunk, kv_b_proj) -> torch.Tensor:
        """One request's chunk of n queries -> [n, H, v], over K/V expanded per head."""
        n = q.shape[0]
        seq_len = p.context_len + n
        if p.context_len:
            latent = cache[p.block_table].view(-1, self.head_size)[:seq_len]
        r, h = self.kv_lora_rank, self.num_heads
        kv = kv_b_proj(latent[:, :r]).view(seq_len, h, self.nope + self.v_dim)
        k = torch.cat([kv[..., :self.nope],
                       latent[:, None, r:].expand(seq_len, h, self.rope_dim)], dim=-1)
        qh, kh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0)
        vh = kv[..., self.nope:].transpose(0, 1).unsqueeze(0)
        if p.context_len == 0:
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale)
        else:
            # Query i sits at position context_len + i and sees keys 0..context_len + i.
            kpos = torch.arange(seq_len, device=q.device)[None, :]
            qpos = torch.arange(p.context_len, seq_len, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=kpos <= qpos,
                                               scale=self.scale)
        return o.squeeze(0).transpose(0, 1)
