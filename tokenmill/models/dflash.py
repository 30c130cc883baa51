"""DFlash: the block-diffusion draft model of speculative decoding (method "dflash").

A DFlash drafter is a few Qwen3-style decoder layers that read the target's hidden
states instead of their own history. Per request it keeps a *context*: for every
token the target has committed, the target's hidden states after the layers
`dflash_config.target_layer_ids`, concatenated, projected by `fc` and normalised by
`hidden_norm`. Each draft layer turns that context into K/V of its own (its k/v
projections, k-norm and rotary at the token's position; no input norm), computed
once per token (`write_context`) and kept in the paged KV cache: the draft layers
are PagedAttention layers of the target's KV cache group ("draft.<i>.attn"), so a
prefix-cache hit (or an external-tier load) brings the cached prefix's draft
context with its target K/V. A position's context depends on the tokens up to it
only (the target's hidden state there), so the block hash covers it.

One draft step is one forward over a block [last token, mask x k] at positions
p .. p + k: the block's K/V go into the request's slots p .. p + k (past its
context; the next context write overwrites them) and its queries attend to the
context and to each other in both directions: in a full layer the block's k + 1
rows attend as one decode query with (k + 1) x the heads whose sequence ends at
p + k (no causal mask inside the block; the context read once per request, no
copy). A sliding layer's rows are causal decode queries at their own positions
with the window. The k drafts are the argmax of the block's rows 1 .. k: k drafts
cost one forward.

The context grows only by accepted tokens: a verified step writes the rows of the
tokens the target kept (the last token and the accepted drafts), never those of
rejected drafts. The token the step emitted has no target hidden state yet: it is
the next block's first token, at position p = the context's end.

Checkpoints (z-lab's Qwen3-DFlash layout) usually ship neither `embed_tokens` nor
`lm_head`: the drafter then uses the target's (mask tokens embed as the target's
row `mask_token_id`, or a dedicated mask embedding where the folder has
`mask_embedding.pt` or a `mask_embedding` tensor); one that ships its own uses those.
A head with a reduced draft vocabulary (`draft_vocab_size` < vocab_size) ships its own
lm_head over the draft ids and `d2t` (target id = draft id + d2t[draft id], EAGLE-3's
convention): its drafts are mapped to target ids before verification.
"""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from safetensors import safe_open
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import DecoderConfig
from tokenmill.models.quantization import check_quantization


class DFlashConfig(DecoderConfig):
    """The draft's Qwen3 fields plus `dflash_config`; refuses the variants not built here."""

    def __init__(self, cfg: dict):
        cfg = dict(cfg)
        if "rope_theta" not in cfg and "rope_theta" not in (cfg.get("rope_parameters") or {}):
            cfg["rope_theta"] = 1e6  # Qwen3's, the default DFlash drafts are trained with
        super().__init__(cfg, qk_norm=True)
        d = cfg.get("dflash_config") or {}
        for key in ("target_layer_ids", "mask_token_id"):
            if d.get(key) is None:
                raise ValueError(f"DFlash config lacks dflash_config.{key}")
        self.target_layer_ids = tuple(int(i) for i in d["target_layer_ids"])
        if not self.target_layer_ids:
            raise ValueError("DFlash dflash_config.target_layer_ids is empty")
        self.mask_token_id = int(d["mask_token_id"])
        self.block_size = int(d.get("block_size", 16))
        self.target_hidden_size = int(cfg.get("target_hidden_size") or self.hidden_size)
        # A reduced draft vocabulary: the draft's own lm_head covers these ids, `d2t`
        # maps them to the target's (as EAGLE-3 heads do).
        self.draft_vocab_size = int(cfg.get("draft_vocab_size") or self.vocab_size)
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"DFlash draft_vocab_size {self.draft_vocab_size} must be in "
                             f"1..vocab_size ({self.vocab_size})")
        # Other checkpoints' variants (sliding-window or causal layers, attention sinks,
        # a reduced draft vocabulary, scaled embeddings or logits): refused, not ignored.
        unsupported = {
            "dflash_config.use_swa": d.get("use_swa", False),
            "dflash_config.causal": d.get("causal", False),
            "dflash_config.attention_sink_bias": d.get("attention_sink_bias", False),
            "dflash_config.use_aux_hidden_state": not d.get("use_aux_hidden_state", True),
        }
        for key in ("input_embedding_scale", "output_multiplier"):
            unsupported[key] = float(d.get(key, cfg.get(key, 1.0))) != 1.0
        unsupported["final_logit_softcapping"] = bool(
            d.get("final_logit_softcapping", cfg.get("final_logit_softcapping")))
        bad = [k for k, v in unsupported.items() if v]
        if bad:
            raise ValueError(f"DFlash checkpoint uses {', '.join(bad)}: not supported")
        # Layer kinds as the reference has them: "full_attention" layers see the whole
        # context and the whole block; "sliding_attention" ones are causal inside the
        # block and see the last `sliding_window` positions (their own included). No
        # layer_types: every layer full.
        types = cfg.get("layer_types") or ["full_attention"] * self.num_layers
        if len(types) != self.num_layers or set(types) - {"full_attention",
                                                          "sliding_attention"}:
            raise ValueError(f"DFlash layer_types {types}: one of full_attention / "
                             f"sliding_attention per layer ({self.num_layers})")
        window = cfg.get("sliding_window")
        if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
            raise ValueError(f"DFlash layer_types has sliding_attention layers but "
                             f"sliding_window is {window!r}")
        self.layer_windows = [window if t == "sliding_attention" else None for t in types]
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(f"DFlash dflash_config.mask_token_id {self.mask_token_id} is "
                             f"outside the vocabulary (vocab_size {self.vocab_size})")


class DFlashAttention(nn.Module):
    def __init__(self, c: DFlashConfig, window: int | None):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        # q apart from k/v: the context needs only k/v, for every committed token.
        self.q_proj = Linear(c.hidden_size, c.num_heads * c.head_dim, bias=c.qkv_bias)
        self.kv_proj = Linear(c.hidden_size, 2 * c.num_kv_heads * c.head_dim, bias=c.qkv_bias)
        self.o_proj = Linear(c.num_heads * c.head_dim, c.hidden_size, bias=c.o_bias)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.attn = PagedAttention(c.num_heads, c.num_kv_heads, c.head_dim,
                                   c.head_dim ** -0.5, sliding_window=window)
        # A window only masks this layer's reads: its cache keeps every position, so it
        # shares the target's full-attention group (one block table, one page per block).
        self.attn.cache_all_positions = True

    def key_value(self, x, cos, sin, rotary: RotaryEmbedding):
        """[T, H] -> k, v [T, Hkv, D]: k normed and rotated, v as projected."""
        k, v = self.kv_proj(x).view(-1, 2, self.num_kv_heads, self.head_dim).unbind(1)
        return rotary.apply(self.k_norm(k), cos, sin), v

    def forward(self, x, cos, sin, rotary, meta):
        """x [R*B, H] (R blocks of B rows). A full layer (`meta`: the pair (write, read)
        of block_metas): the block's K/V are written at its rows' slots, then the B rows
        attend as one decode query of B x the heads over the request's cache to the
        block's end (the rotary is applied already: a row's keys and its place in the
        block are all the attention needs), reading the context once. A sliding layer
        (`meta`: one decode query per row): each row writes and attends to its own
        position, windowed."""
        q = rotary.apply(self.q_norm(self.q_proj(x).view(-1, self.num_heads, self.head_dim)),
                         cos, sin)
        k, v = self.key_value(x, cos, sin, rotary)
        if not isinstance(meta, tuple):
            return self.o_proj(self.attn(q, k, v, meta))
        write, read = meta
        self.attn.write_kv(k, v, write)
        r, d, hkv = read.num_decodes, self.head_dim, self.num_kv_heads
        b, g = q.shape[0] // r, self.num_heads // hkv
        # [R, B, Hkv, G, D] -> [R, Hkv, B, G, D]: kv head h's queries side by side.
        wide = q.view(r, b, hkv, g, d).transpose(1, 2).reshape(r, hkv * b * g, d)
        o = self.attn.read_decodes(wide, read).view(r, hkv, b, g, d).transpose(1, 2)
        return self.o_proj(o.reshape(r * b, self.num_heads * d))


class DFlashLayer(nn.Module):
    def __init__(self, c: DFlashConfig, window: int | None):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DFlashAttention(c, window)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)

    def forward(self, x, cos, sin, rotary, meta):
        # x is this step's own residual stream: updated in place.
        h = self.self_attn(self.input_layernorm(x), cos, sin, rotary, meta)
        return x.add_(self.mlp(self.post_attention_layernorm.add_forward(x, h)))


class DFlashDraftModel(nn.Module):
    # Checkpoint names packed into one parameter: (packed name, shard index).
    packed_modules = {"k_proj": ("kv_proj", 0), "v_proj": ("kv_proj", 1),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, hf_config: dict, *, own_embed: bool = False, own_lm_head: bool = False):
        super().__init__()
        c = self.config = DFlashConfig(hf_config)
        self.fc = Linear(len(c.target_layer_ids) * c.target_hidden_size, c.hidden_size,
                         bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashLayer(c, w) for w in c.layer_windows)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = RotaryEmbedding(c.head_dim, c.rotary_dim, c.max_position_embeddings,
                                      c.rope_params)
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size) if own_embed else None
        if c.draft_vocab_size != c.vocab_size and not own_lm_head:
            raise ValueError(f"DFlash draft_vocab_size {c.draft_vocab_size} < vocab_size "
                             f"{c.vocab_size} needs the draft's own lm_head")
        self.draft_vocab_size = c.draft_vocab_size
        self.lm_head = Linear(c.hidden_size, c.draft_vocab_size, bias=False) \
            if own_lm_head else None
        # draft id -> target id is id + d2t[id] (zeros: the same ids); t2d marks the
        # target ids a draft can name. Filled from the checkpoint's maps at load.
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self._vocab_maps: dict[str, torch.Tensor] = {}
        # A separate learned embedding [H] for the mask rows (mask_embedding.pt, or a
        # `mask_embedding` tensor); None: the mask token's row of the embedding.
        self.register_buffer("mask_embedding", None)
        # The target's embedding / lm_head where the checkpoint has none. A tuple, not
        # submodules: the platform must not prepare (repack) the target's layers again.
        self._target_io: tuple[nn.Module, nn.Module] | None = None

    @property
    def target_layer_ids(self) -> tuple[int, ...]:
        """The target layers whose *output* hidden states (HF output_hidden_states[i + 1])
        the context is built from, concatenated in this order."""
        return self.config.target_layer_ids

    def share_target(self, target: nn.Module) -> None:
        self._target_io = (target.embed_tokens, target.lm_head)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        embed = self.embed_tokens if self.embed_tokens is not None else self._target_io[0]
        x = embed(ids)
        if self.mask_embedding is not None:
            # A dedicated mask embedding stands in for every mask_token_id row (as the
            # reference substitutes it by id).
            x = torch.where((ids == self.config.mask_token_id)[:, None],
                            self.mask_embedding.to(x.dtype), x)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self.lm_head if self.lm_head is not None else self._target_io[1]
        return head(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        """The draft layers' attention, in order: the runner gives them KV caches in the
        target's group and binds their implementations."""
        return [layer.self_attn.attn for layer in self.layers]

    def context_kv(self, target_hidden: torch.Tensor, positions: torch.Tensor
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Target hidden states [T, n * H_target] (concatenated as target_layer_ids) at
        `positions` [T] -> each layer's context (k, v), [T, Hkv, D] each. Row by row
        independent, so writing in pieces gives the same rows as all at once."""
        ctx = self.hidden_norm(self.fc(target_hidden.to(self.norm.weight.dtype)))
        cos, sin = self.rotary.cos_sin(positions, ctx.dtype)
        return [layer.self_attn.key_value(ctx, cos, sin, self.rotary) for layer in self.layers]

    @torch.inference_mode()
    def write_context(self, target_hidden: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata) -> None:
        """Every layer's context K/V of the kept rows into the paged cache at `meta`'s
        slots (a write-only metadata: row i at positions[i])."""
        for layer, (k, v) in zip(self.layers, self.context_kv(target_hidden, positions)):
            layer.self_attn.attn.write_kv(k, v, meta)

    @property
    def shares_target_lm_head(self) -> bool:
        """Drafts come from the target's own lm_head (no lm_head in the checkpoint)."""
        return self.lm_head is None

    @torch.inference_mode()
    def draft_logits(self, last_token_ids, positions, k: int, metas: dict) -> torch.Tensor:
        """Logits [R, k, V] of the block rows 1..k of each request; its block is
        [last_token_ids[r], mask x k] at positions[r] .. positions[r] + k, where
        last_token_ids[r] is the token the last step emitted and positions[r] its
        position: the end of the request's context in the cache. `metas`: the block
        rows as decode queries (DFlashDraftModel.block_metas), by layer window."""
        logits = self.compute_logits(self.draft_hidden(last_token_ids, positions, k, metas))
        return logits.view(len(positions), k, logits.shape[-1])

    @torch.inference_mode()
    def draft_hidden(self, last_token_ids, positions, k: int, metas: dict) -> torch.Tensor:
        """The normed hidden states [R * k, H] that draft_logits projects (request-major)."""
        c = self.config
        if not 1 <= k < c.block_size:
            raise ValueError(f"DFlash drafts k={k}: the draft was trained on blocks of "
                             f"{c.block_size} (k from 1 to {c.block_size - 1})")
        device = self.norm.weight.device
        last = torch.as_tensor(last_token_ids, dtype=torch.long, device=device)
        pos = torch.as_tensor(positions, dtype=torch.long, device=device)
        r, b = last.shape[0], k + 1
        if r == 0:
            return torch.empty(0, c.hidden_size, device=device)
        ids = torch.full((r, b), c.mask_token_id, dtype=torch.long, device=device)
        ids[:, 0] = last
        # Past the rotary table (the last steps of a max-length request) the drafts will
        # be cut off anyway; clamp as the reference does rather than fail.
        block_pos = (pos[:, None] + torch.arange(b, device=device)).clamp(
            max=self.rotary.cos_cache.shape[0] - 1).flatten()
        x = self.embed(ids.flatten())
        cos, sin = self.rotary.cos_sin(block_pos, x.dtype)
        full = (metas["write"], metas["read"]) if None in c.layer_windows else None
        for layer, w in zip(self.layers, c.layer_windows):
            x = layer(x, cos, sin, self.rotary, full if w is None else metas[w])
        return self.norm(x.view(r, b, -1)[:, 1:].reshape(r * k, -1))

    def block_metas(self, builder, table, rows: np.ndarray, positions: np.ndarray, k: int
                    ) -> dict:
        """The metadata of the blocks of batch rows `rows` at `positions` (their last
        tokens'). Full layers: "write" (the block's k + 1 rows' K/V at p..p+k) and
        "read" (one decode query per block, its sequence ending at p + k: both
        directions inside the block). Each sliding layer's window w: one decode query
        per block row at its own position (the window masks the rest)."""
        b = k + 1
        q_rows = np.repeat(rows, b)
        q_pos = (positions[:, None] + np.arange(b)).reshape(-1).astype(np.int64)
        out = {w: builder.decodes(table, q_rows, q_pos)
               for w in set(self.config.layer_windows) - {None}}
        if None in self.config.layer_windows:
            out["write"] = builder.write_only(table, q_rows, q_pos)
            out["read"] = builder.decodes(table, rows, (positions + k).astype(np.int64))
        return out

    @torch.inference_mode()
    def propose(self, last_token_ids, positions, k: int, metas: dict) -> torch.Tensor:
        """Greedy drafts [R, k] (target vocabulary ids) for a batch of requests."""
        draft = self.draft_logits(last_token_ids, positions, k, metas).argmax(-1)
        if self.draft_vocab_size == self.config.vocab_size:
            return draft
        return draft + self.d2t[draft]

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """The vocabulary maps are kept aside for set_vocab_maps; the rest loads as is."""
        bare = name.removeprefix("model.")
        if bare in ("d2t", "t2d", "mask_embedding"):
            self._vocab_maps[bare] = tensor
            return
        yield name, tensor

    def set_mask_embedding(self, tensor: torch.Tensor, where: str) -> None:
        h = self.config.hidden_size
        if not isinstance(tensor, torch.Tensor) or tensor.numel() != h \
                or not tensor.dtype.is_floating_point:
            raise ValueError(f"{where}: the mask embedding must be {h} floats, got "
                             f"{getattr(tensor, 'dtype', type(tensor).__name__)} "
                             f"{tuple(getattr(tensor, 'shape', ()))}")
        self.mask_embedding = tensor.reshape(h).to(self.norm.weight.device,
                                                   self.norm.weight.dtype)


def _checkpoint_names(path: str) -> set[str]:
    from tokenmill.models.checkpoint_io import safetensors_files
    names = set()
    for f in safetensors_files(path):
        with safe_open(f, framework="pt") as st:
            names.update(n.removeprefix("model.") for n in st.keys())
    return names


def load_dflash_drafter(path: str, target: nn.Module, dtype: torch.dtype,
                        device: torch.device, platform) -> DFlashDraftModel:
    """Build the drafter from a DFlash folder for `target` (a loaded tokenmill model),
    check that the two fit, fill it, and hand it the platform's kernel decisions."""
    from tokenmill.models.loader import load_weights
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"DFlash draft {path}: no config.json")
    with open(config_path) as f:
        hf_config = json.load(f)
    # A drafter places no quantized layers (yet): every quantized format is refused.
    check_quantization(hf_config, f"DFlash draft {path}", implemented=())
    names = _checkpoint_names(path)
    own_embed, own_head = "embed_tokens.weight" in names, "lm_head.weight" in names
    c, tc = DFlashConfig(hf_config), target.config
    bad_ids = [i for i in c.target_layer_ids if not 0 <= i < tc.num_layers]
    if bad_ids:
        raise ValueError(f"DFlash dflash_config.target_layer_ids {list(c.target_layer_ids)}: "
                         f"{bad_ids} outside the target's {tc.num_layers} layers")
    if c.vocab_size != tc.vocab_size:
        raise ValueError(f"DFlash draft vocab_size {c.vocab_size} != the target's "
                         f"{tc.vocab_size} (drafts are target token ids)")
    if c.target_hidden_size != tc.hidden_size:
        raise ValueError(f"DFlash draft reads target hidden states of size "
                         f"{c.target_hidden_size}, the target's are {tc.hidden_size}")
    if not (own_embed and own_head) and c.hidden_size != tc.hidden_size:
        raise ValueError(f"DFlash draft hidden_size {c.hidden_size} != the target's "
                         f"{tc.hidden_size}, whose embedding / lm_head it shares")
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = DFlashDraftModel(hf_config, own_embed=own_embed, own_lm_head=own_head)
    finally:
        torch.set_default_dtype(default)
    load_weights(model, path)
    maps, model._vocab_maps = model._vocab_maps, {}
    mask_file = os.path.join(path, "mask_embedding.pt")
    if os.path.exists(mask_file):  # tensors only: no pickled code runs
        model.set_mask_embedding(torch.load(mask_file, map_location="cpu", weights_only=True),
                                 f"DFlash draft {mask_file}")
    elif "mask_embedding" in maps:
        model.set_mask_embedding(maps.pop("mask_embedding"), f"DFlash draft {path}")
    maps.pop("mask_embedding", None)
    if model.draft_vocab_size != c.vocab_size and "d2t" not in maps:
        raise ValueError(f"DFlash draft {path}: draft_vocab_size {c.draft_vocab_size} < "
                         f"vocab_size {c.vocab_size} but no d2t map in the checkpoint")
    from tokenmill.models.eagle3 import set_vocab_maps
    set_vocab_maps(model, maps, path, kind="DFlash")
    model.share_target(target)
    platform.prepare_model(model)
    return model.eval().requires_grad_(False)
