"""Qwen2.5-VL: a ViT over image patches whose merged outputs stand in for the image
placeholder tokens of a Qwen2 decoder that rotates by M-RoPE.

Vision tower (`VisionTransformer`): the image processor's patches [N, C*T*P*P]
(each a temporal_patch_size x patch x patch cube, grouped by spatial_merge_size^2
so a merge group is contiguous) -> patch embedding (the Conv3d with stride = kernel,
i.e. one matmul) -> blocks (RMSNorm, attention with a 2-D rotary over (row, column),
gated SiLU MLP); most blocks attend within windows of window_size pixels, the
`fullatt_block_indexes` ones over the whole frame -> the merger (RMSNorm, the
merge group's patches concatenated, MLP) -> one embedding per placeholder token.
The sequence runs window-ordered through the blocks and goes back to row-major
order after the merger.

Language model: Qwen2 (`Qwen2ForCausalLM`) whose rotary takes three position ids
per token (temporal, height, width): `mrope_section` splits the rotary frequencies
among them (`MRotaryEmbedding`). A text token has the same id on all three, so a
decode token rotates as plain RoPE at position + the request's delta.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.config import flatten_text_config
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding, cos_sin_table
from tokenmill.models.llama import Qwen2ForCausalLM
from tokenmill.models.weight_names import text_model_name


class VisionTowerConfig:
    """What the Qwen-VL vision towers share (patching, sizes, the 2-D rotary's base)."""

    def __init__(self, cfg: dict):
        self.depth = cfg["depth"]
        self.hidden_size = cfg["hidden_size"]
        self.intermediate_size = cfg["intermediate_size"]
        self.num_heads = cfg["num_heads"]
        self.head_dim = self.hidden_size // self.num_heads
        self.in_channels = cfg.get("in_channels", 3)
        self.patch_size = cfg["patch_size"]
        self.temporal_patch_size = cfg["temporal_patch_size"]
        self.spatial_merge_size = cfg["spatial_merge_size"]
        self.out_hidden_size = cfg["out_hidden_size"]
        rope = cfg.get("rope_parameters") or {}
        self.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))


class VisionConfig(VisionTowerConfig):
    """Qwen2.5-VL's tower: window attention but in the full-attention blocks, SiLU."""

    def __init__(self, cfg: dict):
        super().__init__(cfg)
        self.window_size = cfg["window_size"]
        self.fullatt_block_indexes = set(cfg.get("fullatt_block_indexes") or ())
        act = cfg.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"vision_config.hidden_act {act!r} is not supported (only silu)")


def vision_positions(grid_thw: list[tuple[int, int, int]], merge: int) -> np.ndarray:
    """(row, column) of every patch [N, 2], in the processor's order: merge groups
    row-major, the merge x merge patches of a group row-major inside it, per frame."""
    out = []
    for t, h, w in grid_thw:
        bh, bw, ih, iw = np.meshgrid(np.arange(h // merge), np.arange(w // merge),
                                     np.arange(merge), np.arange(merge), indexing="ij")
        rows = (bh * merge + ih).reshape(-1)
        cols = (bw * merge + iw).reshape(-1)
        out.append(np.tile(np.stack([rows, cols], axis=1), (t, 1)))
    return np.concatenate(out)


def window_order(grid_thw: list[tuple[int, int, int]], merge: int, window: int):
    """Window attention's order of the merged tokens and its segments.

    The merged grid of each frame is tiled by `window` x `window` squares (the last
    ones cut by the edge); tokens are ordered window by window (windows row-major),
    row-major inside a window. Returns (order [M]: merged token index at each place,
    window lengths in merged tokens, frame lengths in merged tokens)."""
    order, windows, frames = [], [], []
    base = 0
    for t, h, w in grid_thw:
        gh, gw = h // merge, w // merge
        nwh, nww = -(-gh // window), -(-gw // window)
        i, j = np.meshgrid(np.arange(gh), np.arange(gw), indexing="ij")
        win = (i // window) * nww + j // window
        for f in range(t):
            key = (win * gh * gw + i * gw + j).reshape(-1)
            order.append(base + np.argsort(key, kind="stable"))
            counts = np.bincount(win.reshape(-1), minlength=nwh * nww)
            windows.extend(int(c) for c in counts if c)
            frames.append(gh * gw)
            base += gh * gw
    return np.concatenate(order), windows, frames


class VisionAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.num_heads, self.head_dim = c.num_heads, c.hidden_size // c.num_heads
        self.qkv = Linear(c.hidden_size, 3 * c.hidden_size, bias=True)
        self.proj = Linear(c.hidden_size, c.hidden_size, bias=True)

    def forward(self, x, cos, sin, segments: list[int]):
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        # rotary in fp32, as the reference computes it
        q = _rotate(q.float(), cos, sin).to(x.dtype)
        k = _rotate(k.float(), cos, sin).to(x.dtype)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))  # [heads, N, d]
        out = torch.empty_like(q)
        start = 0
        for length in segments:  # bidirectional attention inside each segment
            end = start + length
            out[:, start:end] = F.scaled_dot_product_attention(
                q[:, start:end], k[:, start:end], v[:, start:end])
            start = end
        return self.proj(out.transpose(0, 1).reshape(n, -1))


def _rotate(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class VisionBlock(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.norm1 = RMSNorm(c.hidden_size, 1e-6)
        self.norm2 = RMSNorm(c.hidden_size, 1e-6)
        self.attn = VisionAttention(c)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=True)

    def forward(self, x, cos, sin, segments):
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, c, bias: bool = False):
        super().__init__()
        k = (c.temporal_patch_size, c.patch_size, c.patch_size)
        self.proj = nn.Conv3d(c.in_channels, c.hidden_size, kernel_size=k, stride=k, bias=bias)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # A convolution whose stride is its kernel, over inputs one kernel in size: a
        # matmul of the flattened (C, T, P, P) patches with the flattened kernels.
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.reshape(w.shape[0], -1), self.proj.bias)


class PatchMerger(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.width = c.hidden_size * c.spatial_merge_size ** 2
        self.ln_q = RMSNorm(c.hidden_size, 1e-6)
        self.mlp = nn.Sequential(Linear(self.width, self.width, bias=True), nn.GELU(),
                                 Linear(self.width, c.out_hidden_size, bias=True))

    def forward(self, x):
        return self.mlp(self.ln_q(x).view(-1, self.width))


class VisionTransformer(nn.Module):
    def __init__(self, c: VisionConfig):
        super().__init__()
        self.config = c
        self.patch_embed = PatchEmbed(c)
        self.blocks = nn.ModuleList(VisionBlock(c) for _ in range(c.depth))
        self.merger = PatchMerger(c)
        half = c.head_dim // 2  # rows take one half of the frequencies, columns the other
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, half, 2, dtype=torch.float) / half))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]) -> torch.Tensor:
        """Patches of one or more images [N, C*T*P*P] -> merged embeddings [N / m^2, out]."""
        c = self.config
        m = c.spatial_merge_size
        unit = m * m
        order, windows, frames = window_order(grid_thw, m, c.window_size // m // c.patch_size)
        order_t = torch.from_numpy(order).to(pixels.device)
        x = self.patch_embed(pixels)
        n = x.shape[0]
        x = x.view(n // unit, unit, -1)[order_t].reshape(n, -1)
        pos = torch.from_numpy(vision_positions(grid_thw, m)).to(pixels.device)
        freqs = (pos[:, :, None].float() * self.inv_freq).reshape(n, -1)  # [N, d/2]: rows, cols
        freqs = freqs.view(n // unit, unit, -1)[order_t].reshape(n, 1, -1)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = cos_sin_table(emb)
        windows = [w * unit for w in windows]
        frames = [f * unit for f in frames]
        for i, blk in enumerate(self.blocks):
            x = blk(x, cos, sin, frames if i in c.fullatt_block_indexes else windows)
        merged = self.merger(x)
        return merged[torch.from_numpy(np.argsort(order)).to(pixels.device)]


class MRotaryEmbedding(RotaryEmbedding):
    """RoPE whose frequencies are split in `mrope_section` parts, rotated by the
    temporal, height and width position ids; positions [3, T] (or [T]: the same id
    on all three). Qwen2.5-VL gives each axis a contiguous run of frequencies;
    `interleaved` (Qwen3-VL) cycles t, h, w over the first 3 x section frequencies
    (the rest stay temporal)."""

    def __init__(self, head_dim, rotary_dim, max_position, params, mrope_section,
                 interleaved: bool = False):
        super().__init__(head_dim, rotary_dim, max_position, params)
        # (the interleaved layout only reads the sections as bounds, as the reference does)
        if not interleaved and sum(mrope_section) != rotary_dim // 2:
            raise ValueError(f"rope_parameters.mrope_section {list(mrope_section)} must sum "
                             f"to rotary_dim / 2 = {rotary_dim // 2}")
        if interleaved:
            axis = np.zeros(rotary_dim // 2, dtype=np.int64)
            axis[1:3 * mrope_section[1]:3] = 1
            axis[2:3 * mrope_section[2]:3] = 2
        else:
            axis = np.repeat(np.arange(len(mrope_section)) % 3, mrope_section)
        self.register_buffer("column_axis", torch.from_numpy(np.concatenate([axis, axis])),
                             persistent=False)
        self.register_buffer("columns", torch.arange(rotary_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if positions.dim() == 1:
            return super().cos_sin(positions, dtype)
        table = self.table(dtype)  # the plain rotary's: a step of either kind may follow
        # column j of token i reads the table at the position of column j's axis
        # (flat offsets: one contiguous [T, rotary_dim] gather per table)
        flat = (positions[self.column_axis].t() * self.rotary_dim + self.columns).contiguous()
        return (table[0].reshape(-1)[flat].unsqueeze(1),
                table[1].reshape(-1)[flat].unsqueeze(1))


def mrope_text_config(hf_config: dict) -> dict:
    """The language model's fields, with an old checkpoint's rope type "mrope" as the
    default rotary it is (the sections are read separately)."""
    cfg = flatten_text_config(hf_config)
    for key in ("rope_parameters", "rope_scaling"):
        params = cfg.get(key)
        if isinstance(params, dict) and params.get("rope_type", params.get("type")) == "mrope":
            cfg[key] = {**params, "rope_type": "default"}
            cfg[key].pop("type", None)
    return cfg


class VisionLanguageMixin:
    """What the Qwen vision-language models share around their text model: the tower
    `visual`, M-RoPE in place of the text model's rotary, the placeholder runs'
    position ids, and the encoder entry points the runner calls. A subclass's
    __init__ builds its text model, then calls `init_vision`."""

    uses_mrope = True

    def init_vision(self, hf_config: dict, tower: nn.Module, interleaved: bool,
                    default_section: list[int] | None = None) -> None:
        c = self.config
        params = c.rope_params
        section = params.get("mrope_section") or default_section
        if not section:
            raise ValueError("rope_parameters.mrope_section is missing from the text config")
        self.rotary = MRotaryEmbedding(c.head_dim, c.rotary_dim, c.max_position_embeddings,
                                       params, section, interleaved=interleaved)
        self.visual = tower
        self.image_token_id = hf_config.get("image_token_id")
        if self.image_token_id is None:
            raise ValueError("image_token_id is missing from the config")
        self.spatial_merge_size = tower.config.spatial_merge_size

    @staticmethod
    def vision_config(hf_config: dict) -> dict:
        vision = hf_config.get("vision_config")
        if not isinstance(vision, dict):
            raise ValueError("vision_config is missing from the config")
        return vision

    def num_image_tokens(self, grid_thw) -> int:
        t, h, w = grid_thw
        return t * h * w // self.spatial_merge_size ** 2

    def encode_images(self, pixels: torch.Tensor, grids: list[tuple[int, int, int]]
                      ) -> list[torch.Tensor]:
        """Patches of several images (concatenated) -> one embedding tensor per image."""
        out = self.visual(pixels, grids)
        return list(out.to(self.embed_tokens.weight.dtype).split(
            [self.num_image_tokens(g) for g in grids]))

    def embed_multimodal(self, input_ids: torch.Tensor, index: torch.Tensor | None,
                         embeds: torch.Tensor | None) -> torch.Tensor:
        """Token embeddings with rows `index` replaced by image embeddings."""
        x = self.embed_tokens(input_ids)
        if index is not None:
            x[index] = embeds.to(x.dtype)
        return x

    def mrope_positions(self, num_tokens: int, images: list[tuple[int, int, tuple]]
                        ) -> tuple[np.ndarray, int]:
        """M-RoPE position ids of a prompt [3, num_tokens] and its delta (what decode
        positions add to the token index). `images`: (offset, length, (t, h, w)) of
        each image's placeholder run, in order. Text tokens count on from the previous
        token (all three ids equal); an image's tokens take (start + frame, start + row,
        start + column) over its merged grid, and the text after it starts at start +
        max(rows, columns)."""
        m = self.spatial_merge_size
        pos = np.empty((3, num_tokens), dtype=np.int64)
        cur = 0  # next position id
        prev = 0  # token index after the previous image
        for offset, length, (t, h, w) in images:
            n_text = offset - prev
            pos[:, prev:offset] = cur + np.arange(n_text)
            cur += n_text
            gh, gw = h // m, w // m
            if length != t * gh * gw:
                raise ValueError(f"image placeholder run of {length} tokens does not match "
                                 f"its grid {t}x{h}x{w} ({t * gh * gw} tokens)")
            ti, hi, wi = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
            pos[:, offset:offset + length] = cur + np.stack(
                [ti.reshape(-1), hi.reshape(-1), wi.reshape(-1)])
            cur += max(gh, gw)
            prev = offset + length
        pos[:, prev:] = cur + np.arange(num_tokens - prev)
        delta = int(pos.max()) + 1 - num_tokens if num_tokens else 0
        return pos, delta

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """Both layouts: HF 4.x (model.layers..., visual...) and 5.x
        (model.language_model..., model.visual...)."""
        name = text_model_name(name)
        if name.startswith("model.visual."):
            name = name[len("model."):]
        elif name.startswith("video") or ".video" in name:
            return
        yield name, tensor


class Qwen2_5_VLForConditionalGeneration(VisionLanguageMixin, Qwen2ForCausalLM):
    """Qwen2.5-VL: the vision tower `visual` and a Qwen2 decoder with M-RoPE."""

    def __init__(self, hf_config: dict):
        text = mrope_text_config(hf_config)
        super().__init__(text)
        hf_config = {**hf_config, "image_token_id": hf_config.get(
            "image_token_id", text.get("image_token_id"))}
        self.init_vision(hf_config, VisionTransformer(VisionConfig(self.vision_config(hf_config))),
                         interleaved=False)
