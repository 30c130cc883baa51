"""Qwen3-VL: Qwen2.5-VL's scheme (patches -> ViT -> merged embeddings at the image
placeholders, M-RoPE) with a different tower and DeepStack.

Vision tower: patch embedding (with bias) plus a learned square grid of position
embeddings, resampled bilinearly (align_corners) to each image's patch grid;
blocks with LayerNorm, full attention per frame (no windows) with the same 2-D
rotary, and a gelu-tanh MLP; the merger (LayerNorm, concat the merge group, MLP).
DeepStack: the outputs of the `deepstack_visual_indexes` blocks go through mergers
of their own (LayerNorm after the concat) and are added to the language model's
hidden states at the image tokens after its first layers, one per layer.

The encoder output of an image is [tokens, (1 + k) * hidden]: the embedding, then
the k DeepStack features, so the runner's encoder cache slices it like any other;
`embed_multimodal` gives the step's [T, (1 + k) * hidden] inputs (zeros past the
embedding on text rows) and forward adds column block i after layer i.

Language model: Qwen3 (q/k norm) with interleaved M-RoPE (`mrope_interleaved`).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.rotary import cos_sin_table
from tokenmill.models.llama import Qwen3ForCausalLM
from tokenmill.models.qwen2_5_vl import (PatchEmbed, VisionAttention, VisionLanguageMixin,
                                         VisionTowerConfig, mrope_text_config,
                                         vision_positions)

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
         "gelu": F.gelu, "silu": F.silu}


class Qwen3VisionConfig(VisionTowerConfig):
    """Qwen3-VL's tower: a learned position grid, DeepStack taps, its activation."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.num_position_embeddings = cfg["num_position_embeddings"]
        self.grid_side = int(round(self.num_position_embeddings ** 0.5))
        self.deepstack_visual_indexes = list(cfg.get("deepstack_visual_indexes") or ())
        act = cfg.get("hidden_act", "gelu_pytorch_tanh")
        if act not in _ACTS:
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported "
                             f"(supported: {', '.join(_ACTS)})")
        self.act = _ACTS[act]


class VisionBlock(nn.Module):
    def __init__(self, c: Qwen3VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(c.hidden_size, eps=1e-6)
        self.attn = VisionAttention(c)
        self.mlp = nn.Module()
        self.mlp.linear_fc1 = Linear(c.hidden_size, c.intermediate_size, bias=True)
        self.mlp.linear_fc2 = Linear(c.intermediate_size, c.hidden_size, bias=True)
        self.act = c.act

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp.linear_fc2(self.act(self.mlp.linear_fc1(self.norm2(x))))


class PatchMerger(nn.Module):
    """LayerNorm (before the merge group's concat, or after it: `postshuffle`), MLP."""

    def __init__(self, c: Qwen3VisionConfig, postshuffle: bool):
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size ** 2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.width if postshuffle else c.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.width, self.width, bias=True)
        self.linear_fc2 = Linear(self.width, c.out_hidden_size, bias=True)

    def forward(self, x):
        x = self.norm(x.view(-1, self.width)) if self.postshuffle \
            else self.norm(x).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def grid_interpolation(grid_thw, side: int, merge: int):
    """Bilinear (align_corners) resampling of a side x side grid to each image's patch
    grid, in the processor's patch order: (table indices [N, 4], weights [N, 4])."""
    idx, wts = [], []
    for t, h, w in grid_thw:
        rc = torch.from_numpy(vision_positions([(t, h, w)], merge))
        taps, weights = [], []
        for axis, size in ((0, h), (1, w)):
            src = rc[:, axis].float() * (side - 1) / max(size - 1, 1)
            lo = src.floor()
            frac = src - lo
            lo = lo.long()
            taps.append((lo, (lo + 1).clamp(max=side - 1)))
            weights.append((1 - frac, frac))
        (r0, r1), (c0, c1) = taps
        (wr0, wr1), (wc0, wc1) = weights
        idx.append(torch.stack([r0 * side + c0, r0 * side + c1, r1 * side + c0,
                                r1 * side + c1], dim=1))
        wts.append(torch.stack([wr0 * wc0, wr0 * wc1, wr1 * wc0, wr1 * wc1], dim=1))
    return torch.cat(idx), torch.cat(wts)


class Qwen3VisionModel(nn.Module):
    def __init__(self, c: Qwen3VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c, bias=True)
        self.pos_embed = nn.Embedding(c.num_position_embeddings, c.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(c, postshuffle=True) for _ in c.deepstack_visual_indexes)
        half = c.head_dim // 2
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixels: torch.Tensor, grid_thw) -> torch.Tensor:
        """Patches [N, C*T*P*P] -> [N / m^2, (1 + deepstack) * out]."""
        c = self.config
        m = c.spatial_merge_size
        dev = pixels.device
        x = self.patch_embed(pixels)
        idx, wts = grid_interpolation(grid_thw, c.grid_side, m)
        pos = (self.pos_embed(idx.to(dev)) * wts.to(dev)[:, :, None]).sum(1)
        x = x + pos.to(x.dtype)
        n = x.shape[0]
        rc = torch.from_numpy(vision_positions(grid_thw, m)).to(dev)
        freqs = (rc[:, :, None].float() * self.inv_freq).reshape(n, 1, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = cos_sin_table(emb)
        frames = [h * w for t, h, w in grid_thw for _ in range(t)]
        deep = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames)
            if i in c.deepstack_visual_indexes:
                deep.append(self.deepstack_merger_list[c.deepstack_visual_indexes.index(i)](x))
        return torch.cat([self.merger(x)] + deep, dim=1)


class Qwen3VLForConditionalGeneration(VisionLanguageMixin, Qwen3ForCausalLM):
    """Qwen3-VL: the vision tower `visual` (with DeepStack) and a Qwen3 decoder with
    interleaved M-RoPE."""

    # The DeepStack forward of an image step does not tap the layers a drafter reads.
    provides_aux_hidden = False

    def __init__(self, hf_config: dict):
        super().__init__(mrope_text_config(hf_config))
        interleaved = bool(self.config.rope_params.get("mrope_interleaved", True))
        self.init_vision(hf_config, Qwen3VisionModel(Qwen3VisionConfig(
            self.vision_config(hf_config))), interleaved=interleaved)
        self.num_deepstack = len(self.visual.config.deepstack_visual_indexes)
        if self.num_deepstack > len(self.layers):
            raise ValueError(f"{self.num_deepstack} deepstack features for "
                             f"{len(self.layers)} decoder layers")

    def embed_multimodal(self, input_ids: torch.Tensor, index: torch.Tensor | None,
                         embeds: torch.Tensor | None) -> torch.Tensor:
        """[T, (1 + k) * hidden]: token embeddings (image rows: the image's), then the
        DeepStack features of the image rows (zeros elsewhere)."""
        h = self.config.hidden_size
        emb = self.embed_tokens(input_ids)
        x = emb.new_zeros(emb.shape[0], h * (1 + self.num_deepstack))
        x[:, :h] = emb
        if index is not None:
            x[index] = embeds.to(x.dtype)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, inputs_embeds: torch.Tensor | None = None
                ) -> torch.Tensor:
        h = self.config.hidden_size
        if inputs_embeds is None or inputs_embeds.shape[1] == h:
            return super().forward(input_ids, positions, meta, inputs_embeds)
        x = inputs_embeds[:, :h].contiguous()
        deep = inputs_embeds[:, h:]
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, self.rotary, meta)
            if i < self.num_deepstack:  # (text rows add zeros: unchanged)
                x = x + deep[:, i * h:(i + 1) * h]
        return self.norm(x)
