"""Paged attention on CPU in plain PyTorch.

The cache of one layer is a [num_blocks, 2, block_size, num_kv_heads, head_size]
view (K at index 0, V at 1) over bytes the runner allocated from the layer's
spec. New K/V are written through the slot mapping; reads go through the block
table. Rows come decode-first (the runner reorders the batch), so the decodes
form one batched call and each prompt chunk gets its own causal call.

A sliding-window layer (`sliding_window` = w) lets a query at position p see
keys in (p - w, p], as HF's mask does; its blocks before that window may have
been given back to the pool (the null block or a stale id in the table), so
neither path reads them: the native decode kernel starts at the window, the
PyTorch decode path masks them, a prompt chunk gathers from the first block
its window reaches.
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
    # On CUDA: the Triton kernels (tokenmill/ops/triton_attention.py), or None. They
    # read the flat fields below, which the runner fills only for them.
    triton_ops: object = None
    slot_mapping: torch.Tensor | None = None  # [T] block id * block_size + offset (-1: pad)
    # The prompt chunks at once: query_start_loc [P + 1] from the first chunk's first
    # query, seq_lens [P] (cached + chunk), block_table [P, widest] int32.
    prefill_query_start_loc: torch.Tensor | None = None
    prefill_seq_lens: torch.Tensor | None = None
    prefill_block_table: torch.Tensor | None = None
    prefill_max_query_len: int = 0
    state: StateMetadata | None = None
    # Models with several KV cache groups: each group's own metadata (block tables and
    # slot mapping), by group id; a layer bound to group g reads by_group[g].
    by_group: dict[int, "AttentionMetadata"] | None = None
    _decode_mask: torch.Tensor | None = None

    def for_group(self, group_id: int | None) -> "AttentionMetadata":
        if self.by_group is None or group_id is None:
            return self
        return self.by_group[group_id]

    def decode_mask(self, block_size: int, window: int | None = None) -> torch.Tensor:
        """[nd, 1, 1, L] additive mask hiding each decode row's padded tail and, with a
        sliding `window`, the positions before it (built once a step: one window per
        group)."""
        if self._decode_mask is None:
            width = self.decode_block_table.shape[1] * block_size
            pos = torch.arange(width, device=self.decode_seq_lens.device)
            visible = pos[None, :] < self.decode_seq_lens[:, None]
            if window is not None:
                visible &= pos[None, :] >= self.decode_seq_lens[:, None] - window
            mask = torch.zeros(visible.shape, dtype=torch.float32, device=visible.device)
            self._decode_mask = mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]
        return self._decode_mask


# ops/triton_attention.MAX_HEAD_SIZE (not imported: that module imports triton).
TRITON_MAX_HEAD_SIZE = 512


class PagedAttention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_size: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None,
                 kv_sharing_target: int | None = None):
        """`sliding_window`: keys in (p - w, p] only (None: full attention);
        `logit_softcap`: scores become cap * tanh(scores / cap) (Gemma 2/3; the native
        decode kernel caps too, prompt chunks write the attention out);
        `kv_sharing_target`: the index (in the model's attention_layers()) of the layer
        whose KV cache this one reads and never writes (Gemma 4's KV-shared layers: the
        K/V passed in are that layer's of this step); it gets no cache of its own."""
        super().__init__()
        self.kv_sharing_target = kv_sharing_target
        self.num_heads, self.num_kv_heads, self.head_size = num_heads, num_kv_heads, head_size
        self.scale = scale
        self.sliding_window = sliding_window
        self.logit_softcap = logit_softcap
        # The Triton kernels take any head size up to TRITON_MAX_HEAD_SIZE (the
        # power-of-two block's tail masked), soft-capped or not; a larger head keeps
        # the PyTorch path on CUDA.
        self.triton_kv = 0 < head_size <= TRITON_MAX_HEAD_SIZE
        self.triton_attention = self.triton_kv
        self.kv_cache: torch.Tensor | None = None  # bound by the runner
        self.kv_group: int | None = None  # its KV cache group (bound by the runner)

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> None:
        """k/v [T, Hkv, D] into the paged cache at the step's slots."""
        meta = meta.for_group(self.kv_group)
        cache = self.kv_cache
        if meta.triton_ops is not None and self.triton_kv:
            meta.triton_ops.write_kv(k, v, cache, meta.slot_mapping)
            return
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
        meta = meta.for_group(self.kv_group)
        if self.kv_sharing_target is None:  # (a sharing layer's source wrote them)
            self.write_kv(k, v, meta)
        if meta.triton_ops is not None and self.triton_attention:
            return self._forward_triton(q, cache, meta)
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

    def _forward_triton(self, q, cache, meta: AttentionMetadata) -> torch.Tensor:
        """CUDA: one decode kernel over the decode rows, one prefill kernel over every
        prompt chunk (their K/V are in the cache already)."""
        ops, nd, window = meta.triton_ops, meta.num_decodes, self.sliding_window or 0
        cap = self.logit_softcap or 0.0
        if not meta.prefills:
            return ops.paged_decode(q, cache, meta.decode_block_table, meta.decode_seq_lens,
                                    self.scale, window, softcap=cap).view(q.shape[0], -1)
        out = torch.empty_like(q)
        if nd:
            ops.paged_decode(q[:nd], cache, meta.decode_block_table, meta.decode_seq_lens,
                             self.scale, window, out=out[:nd], softcap=cap)
        ops.paged_prefill(q[nd:], cache, meta.prefill_block_table, meta.prefill_query_start_loc,
                          meta.prefill_seq_lens, meta.prefill_max_query_len, self.scale, window,
                          out=out[nd:], softcap=cap)
        return out.view(q.shape[0], -1)

    def _decode(self, q, cache, meta):
        if meta.native_ops is not None:
            return meta.native_ops.paged_decode(q.contiguous(), cache, meta.decode_block_table,
                                                meta.decode_seq_lens, self.scale,
                                                self.sliding_window or 0,
                                                self.logit_softcap or 0.0)
        # PyTorch path: gather the rows' blocks, then one batched grouped-query matmul.
        nd, hkv, d = q.shape[0], self.num_kv_heads, self.head_size
        blocks = cache[meta.decode_block_table.long()]  # [nd, nb, 2, bs, Hkv, D]
        kv = blocks.transpose(1, 2).reshape(nd, 2, -1, hkv, d)  # [nd, 2, L, Hkv, D]
        keys = kv[:, 0].permute(0, 2, 3, 1)  # [nd, Hkv, D, L]
        values = kv[:, 1].transpose(1, 2)  # [nd, Hkv, L, D]
        qg = q.view(nd, hkv, -1, d)  # [nd, Hkv, G, D]
        scores = self._softcap(torch.matmul(qg, keys).float() * self.scale)
        scores = scores + meta.decode_mask(cache.shape[2], self.sliding_window)
        probs = scores.softmax(dim=-1).to(values.dtype)
        return torch.matmul(probs, values).reshape(nd, self.num_heads, d)

    def _softcap(self, scores: torch.Tensor) -> torch.Tensor:
        if self.logit_softcap is None:
            return scores
        return torch.tanh(scores / self.logit_softcap) * self.logit_softcap

    def _prefill(self, q, k, v, cache, p: PrefillChunk):
        n = q.shape[0]
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
            kh, vh = kv[0, :seq_len - start], kv[1, :seq_len - start]
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
