"""Paged attention on CPU in plain PyTorch.

The cache of one layer is a [num_blocks, 2, block_size, num_kv_heads, head_size]
view (K at index 0, V at 1) over bytes the runner allocated from the layer's
spec. New K/V are written through the slot mapping; reads go through the block
table. Rows come decode-first (the runner reorders the batch), so the decodes
form one batched call and each prompt chunk gets its own causal call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class PrefillChunk:
    """A request computing more than one token this step."""

    query_start: int
    query_end: int
    context_len: int  # tokens already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_needed] block ids of this request


@dataclass
class StateMetadata:
    """Per-step inputs of the recurrent (Gated DeltaNet) layers; None for attention-only models.

    Rows follow the batch order (decodes first, one token each); row i's state
    lives in slot state_indices[i] of every recurrent layer.
    """

    num_decodes: int
    state_indices: torch.Tensor  # [num_reqs] long
    # Multi-token rows: (query_start, query_end, slot), as host ints.
    prefills: list[tuple[int, int, int]] = field(default_factory=list)
    # Speculative decoding: the decode rows hold 1 + drafts tokens each, which must run
    # in order. Step j = (flat token rows [m], slots read [m], slots written [m]) for
    # token j of every row that has one; None: one token per decode row, in place.
    decode_steps: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None


@dataclass
class AttentionMetadata:
    """Everything attention needs for one step; built once by the runner, shared by all layers."""

    num_decodes: int
    # Where each new token's K/V goes: block id and offset inside the block ([T] each).
    slot_block: torch.Tensor
    slot_offset: torch.Tensor
    # Decode rows: their block tables (int32) cut to the widest one, and their lengths.
    decode_block_table: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Native kernels (tokenmill.kernels.cpu_ops()) or None for the PyTorch path.
    native_ops: object = None
    state: StateMetadata | None = None
    _decode_mask: torch.Tensor | None = None

    def decode_mask(self, block_size: int) -> torch.Tensor:
        """[nd, 1, 1, L] additive mask hiding each decode row's padded tail (built once a step)."""
        if self._decode_mask is None:
            width = self.decode_block_table.shape[1] * block_size
            pos = torch.arange(width, device=self.decode_seq_lens.device)
            visible = pos[None, :] < self.decode_seq_lens[:, None]
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            self._decode_mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        return self._decode_mask


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.kv_cache: torch.Tensor | None = None  # bound by the runner

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k/v [T, Hkv, D] into the paged cache at the step's slots."""
        cache = self.kv_cache
        ops = meta.native_ops
        if ops is not None and k.dtype == cache.dtype:
            ops.kv_cache_write(cache, k, v, meta.slot_block, meta.slot_offset)
        else:
            cache[meta.slot_block, 0, meta.slot_offset] = k
            cache[meta.slot_block, 1, meta.slot_offset] = v

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq * D]."""
        cache = self.kv_cache
        self.write_kv(k, v, meta)
        nd = meta.num_decodes
        if not meta.prefills:  # decode-only step: one call, no output copy
            return self._decode(q, cache, meta).view(q.shape[0], -1)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(q[:nd], cache, meta)
        for p in meta.prefills:
            s, e = p.query_start, p.query_end
            out[s:e] = self._prefill(q[s:e], k[s:e], v[s:e], cache, p)
        return out.view(q.shape[0], -1)

    def _decode(self, q, cache, meta):
        if meta.native_ops is not None:
            return meta.native_ops.paged_decode(q.contiguous(), cache, meta.decode_block_table,
                                                meta.decode_seq_lens, self.scale)
        # PyTorch path: gather the rows' blocks, then one batched grouped-query matmul.
        nd, hkv, d = q.shape[0], self.num_kv_heads, self.head_size
        blocks = cache[meta.decode_block_table.long()]  # [nd, nb, 2, bs, Hkv, D]
        kv = blocks.transpose(1, 2).reshape(nd, 2, -1, hkv, d)  # [nd, 2, L, Hkv, D]
        keys = kv[:, 0].permute(0, 2, 3, 1)  # [nd, Hkv, D, L]
        values = kv[:, 1].transpose(1, 2)  # [nd, Hkv, L, D]
        qg = q.view(nd, hkv, -1, d)  # [nd, Hkv, G, D]
        scores = torch.matmul(qg, keys).float() * self.scale + meta.decode_mask(cache.shape[2])
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(nd, self.num_heads, d)

    def _prefill(self, q, k, v, cache, p: PrefillChunk):
        n = q.shape[0]
        qh = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if p.context_len == 0:
            kh, vh = k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
        else:
            seq_len = p.context_len + n
            blocks = cache[p.block_table]  # [nb, 2, bs, Hkv, D]
            kv = blocks.transpose(0, 1).reshape(2, -1, self.num_kv_heads, self.head_size)
            kh = kv[0, :seq_len].transpose(0, 1).unsqueeze(0)
            vh = kv[1, :seq_len].transpose(0, 1).unsqueeze(0)
            # Query i sits at position context_len + i and sees keys 0..context_len + i.
            mask = (torch.arange(seq_len, device=q.device)[None, :]
                    <= torch.arange(p.context_len, seq_len, device=q.device)[:, None])
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=self.scale,
                                               enable_gqa=self.num_heads != self.num_kv_heads)
        return o.squeeze(0).transpose(0, 1)
