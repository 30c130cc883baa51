"""The PyTorch reference backend: paged attention in plain PyTorch, on every device.

New K/V are written through the slot mapping (block id, offset); decode rows gather
their blocks through the block table and run one batched grouped-query matmul pair
(padded tails and a sliding window masked: `AttentionMetadata.decode_mask`); each
prompt chunk runs scaled_dot_product_attention, causal over its own K/V when it has no
cached context, else over its context gathered from the cache with an explicit mask.

A sliding-window layer (`sliding_window` = w) lets a query at position p see keys in
(p - w, p], as HF's mask does; blocks before that window may be back in the pool
(the builder puts the null block in the decode rows' tables; a prompt chunk gathers
from the first block its window reaches). Soft-capping (`logit_softcap`, Gemma 2/3):
scores become cap * tanh(scores / cap), so a capped chunk writes the attention out.

An fp8 cache (float8_e4m3fn, --kv-cache-dtype fp8): K/V are written divided by the
layer's k_scale / v_scale (1.0 unless the checkpoint has them), rounded and saturated
at +-448 (`to_cache_dtype`), and every read widens the gathered blocks to the queries'
dtype times the scale (`from_cache`); a chunk without context attends over its own K/V
rounded the same way (`as_cached`), so the values attention sees never depend on
chunking.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenmill.attention.backend import (AttentionBackend, AttentionImpl, as_cached,
                                        from_cache, is_paged_kv, to_cache_dtype)
from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk


class TorchAttentionImpl(AttentionImpl):
    def write_kv(self, k, v, cache, meta: AttentionMetadata) -> None:
        cache[meta.slot_block, 0, meta.slot_offset] = to_cache_dtype(k, cache, self.k_scale)
        cache[meta.slot_block, 1, meta.slot_offset] = to_cache_dtype(v, cache, self.v_scale)

    def forward(self, q, k, v, cache, meta: AttentionMetadata) -> torch.Tensor:
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: one call, no output copy
            return self.decode(q, cache, meta)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], cache, meta)
        for p in meta.prefills:
            s, e = p.query_start, p.query_end
            out[s:e] = self.prefill(q[s:e], k[s:e], v[s:e], cache, p)
        return out

    def decode(self, q, cache, meta: AttentionMetadata) -> torch.Tensor:
        """The decode rows (one query each) -> [nd, Hq, D]: their blocks gathered, then one
        batched grouped-query matmul."""
        nd, hkv, d = q.shape[0], self.num_kv_heads, self.head_size
        blocks = cache[meta.decode_block_table.long()]  # [nd, nb, 2, bs, Hkv, D]
        kv = blocks.transpose(1, 2).reshape(nd, 2, -1, hkv, d)  # [nd, 2, L, Hkv, D]
        keys = from_cache(kv[:, 0], q.dtype, self.k_scale).permute(0, 2, 3, 1)  # [nd, Hkv, D, L]
        values = from_cache(kv[:, 1], q.dtype, self.v_scale).transpose(1, 2)  # [nd, Hkv, L, D]
        qg = q.view(nd, hkv, -1, d)  # [nd, Hkv, G, D]
        scores = self._softcap(torch.matmul(qg, keys).float() * self.scale)
        scores = scores + meta.decode_mask(cache.shape[2], self.sliding_window)
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(nd, -1, d)  # (q's heads: Hkv * G)

    def _softcap(self, scores: torch.Tensor) -> torch.Tensor:
        if self.logit_softcap is None:
            return scores
        return torch.tanh(scores / self.logit_softcap) * self.logit_softcap

    def prefill(self, q, k, v, cache, p: PrefillChunk) -> torch.Tensor:
        """One request's chunk of n queries (its K/V in the cache already) -> [n, Hq, D]."""
        n = q.shape[0]
        k, v = as_cached(k, cache, self.k_scale), as_cached(v, cache, self.v_scale)
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        window = self.sliding_window
        gqa = self.num_heads != self.num_kv_heads
        if p.context_len == 0 and window is None and self.logit_softcap is None:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=gqa)
            return o.squeeze(0).transpose(0, 1)
        seq_len = p.context_len + n
        # Keys from the first block the chunk's first query can see (a sliding window's
        # earlier blocks may be given back already).
        first = 0 if window is None else max(0, p.context_len - window + 1) // cache.shape[2]
        start = first * cache.shape[2]
        if p.context_len == 0:
            kh, vh = k, v
        else:
            blocks = cache[p.block_table[first:]]  # [nb, 2, bs, Hkv, D]
            kv = blocks.transpose(0, 1).reshape(2, -1, self.num_kv_heads, self.head_size)
            kh = from_cache(kv[0, :seq_len - start], q.dtype, self.k_scale)
            vh = from_cache(kv[1, :seq_len - start], q.dtype, self.v_scale)
        kh, vh = kh.transpose(0, 1).unsqueeze(0), vh.transpose(0, 1).unsqueeze(0)
        # Query i sits at position context_len + i and sees keys start..context_len + i
        # (and, with a window w, only those after context_len + i - w).
        kpos = torch.arange(start, seq_len, device=q.device)[None, :]
        qpos = torch.arange(p.context_len, seq_len, device=q.device)[:, None]
        mask = kpos <= qpos
        if window is not None:
            mask &= kpos > qpos - window
        if self.logit_softcap is None:
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                               enable_gqa=gqa)
        else:  # soft-capped scores: the attention written out
            if gqa:
                rep = self.num_heads // self.num_kv_heads
                kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
            scores = self._softcap(torch.matmul(qh, kh.transpose(-1, -2)).float() * self.scale)
            scores = scores.masked_fill(~mask, float("-inf"))
            o = torch.matmul(scores.softmax(dim=-1).to(vh.dtype), vh)
        return o.squeeze(0).transpose(0, 1)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    impl_class = TorchAttentionImpl

    def supports(self, spec) -> bool:
        return is_paged_kv(spec)
