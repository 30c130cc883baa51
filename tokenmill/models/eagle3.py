"""EAGLE-3 draft model: one decoder layer over [token embedding | target hidden state].

The drafter reads a fused summary of three of the target's hidden states (`fc` over
their concatenation, combine_target_hidden), normalises it and the next token's
embedding separately, and runs one Llama layer whose q/k/v take both side by side.
Its residual stream starts from the hidden state, not the embedding; that stream
(before the final norm) is what the next draft step takes as its hidden state.
The lm_head covers a reduced draft vocabulary; `d2t` maps a draft id to the target
id (target = draft + d2t[draft]).

Checkpoint (as published for the Llama-3.1-8B drafters): config.json (Llama fields,
`draft_vocab_size`, optional `eagle_config.eagle_aux_hidden_state_layer_ids`) and
fc / midlayer.* / norm / lm_head / d2t / t2d tensors, optionally embed_tokens
(absent: the target's embedding is shared), names with or without a `model.` prefix.
Heads exported in the HF decoder's naming call their one layer `layers.0.*`: the same
tensors (`_layer_name`); a `layers.1.*` is a second layer this drafter does not have
(an unknown tensor, refused by name).
"""
from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.mlp import GatedMLP
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.layers.rotary import RotaryEmbedding
from tokenmill.models.llama import Attention, DecoderConfig
from tokenmill.models.checkpoint_io import safetensors_files
from tokenmill.models.loader import UNUSED_TENSOR_SUFFIXES, _copy, _param_name
from tokenmill.models.quantization import check_quantization

# Checkpoint matrices packed into one parameter (as in llama.py).
PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def default_aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """The target layers whose input hidden state is tapped when the config names none.

    vLLM's default (2, L // 2, L - 3) - a low, a middle and a late layer - is used
    wherever it gives three distinct, increasing ids (L >= 7: every real target). A
    smaller target (tests) gets (1, L // 2, L - 1) clamped to its layers instead, so
    L = 4 -> (1, 2, 3), L = 2 -> (1, 1, 1): ids may then repeat, and each id is one
    slot of the concatenation (tap by list position, not by set membership).
    """
    if num_layers < 1:
        raise ValueError(f"a target needs at least one layer, got {num_layers}")
    ids = (2, num_layers // 2, num_layers - 3)
    if 0 <= ids[0] < ids[1] < ids[2] < num_layers:
        return ids
    top = num_layers - 1
    return min(1, top), min(num_layers // 2, top), top


def aux_layer_ids_from_config(cfg: dict, num_layers: int) -> tuple[int, ...]:
    ids = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return default_aux_layer_ids(num_layers)
    ids = tuple(int(i) for i in ids)
    bad = [i for i in ids if not 0 <= i < num_layers]
    if not ids or bad:
        raise ValueError(f"eagle_aux_hidden_state_layer_ids {list(ids)}: each must name a layer "
                         f"of the target (0..{num_layers - 1})")
    return ids


class Eagle3Layer(nn.Module):
    """The drafter's one decoder layer (checkpoint prefix `midlayer.`)."""

    def __init__(self, c: DecoderConfig, norm_before_residual: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the embedding
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)  # on the hidden state
        self.self_attn = Attention(c, input_size=2 * c.hidden_size)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = GatedMLP(c.hidden_size, c.intermediate_size, bias=c.mlp_bias)
        # Some drafters were trained with the residual stream starting from the normed
        # hidden state (config `norm_before_residual`); the published ones from the raw one.
        self.norm_before_residual = norm_before_residual

    def write_kv(self, emb, hidden, cos, sin, rotary: RotaryEmbedding,
                 meta: AttentionMetadata) -> None:
        """Only the K/V forward would write for these rows."""
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hidden)], dim=-1)
        self.self_attn.write_kv(x, cos, sin, rotary, meta)

    def forward(self, emb, hidden, cos, sin, rotary: RotaryEmbedding, meta: AttentionMetadata):
        h = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(emb), h], dim=-1)
        # The attention output is this call's own tensor: the residual stream is built in
        # it, in place (the caller's `hidden` is never written; it may be read again).
        r = self.self_attn(x, cos, sin, rotary, meta)
        residual = h if self.norm_before_residual else hidden
        normed = self.post_attention_layernorm.add_forward(r, residual)
        return r.add_(self.mlp(normed))


class Eagle3DraftModel(nn.Module):
    """An EagleStyleDrafter (tokenmill/spec_decode/draft_model.py) for `target`."""

    def __init__(self, hf_config: dict, target: nn.Module, own_embedding: bool = True):
        super().__init__()
        c = self.config = DecoderConfig(hf_config)
        tc = target.config
        if c.num_layers != 1:
            raise ValueError(f"an EAGLE-3 drafter has one decoder layer; this config has "
                             f"num_hidden_layers={c.num_layers}")
        if c.vocab_size != tc.vocab_size:
            raise ValueError(f"EAGLE-3 drafter vocab_size {c.vocab_size} != the target's "
                             f"{tc.vocab_size}: its drafts are target token ids, so the two "
                             f"must share one vocabulary (a drafter for another target?)")
        self.draft_vocab_size = hf_config.get("draft_vocab_size") or c.vocab_size
        self.aux_layer_ids: tuple[int, ...] = aux_layer_ids_from_config(hf_config, tc.num_layers)
        self.target_hidden_size = tc.hidden_size
        self.fc = Linear(len(self.aux_layer_ids) * tc.hidden_size, c.hidden_size, bias=False)
        if own_embedding:
            self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
            self._shared_embed = ()
        else:
            shared = getattr(target, "embed_tokens", None)
            if shared is None or shared.embedding_dim != c.hidden_size:
                raise ValueError(f"the EAGLE-3 checkpoint has no embed_tokens and the target's "
                                 f"embedding cannot stand in (the drafter's hidden_size is "
                                 f"{c.hidden_size}, the target's embedding "
                                 f"{getattr(shared, 'embedding_dim', None)})")
            self.embed_tokens = None
            # A tuple keeps it out of this module's parameters: the target owns it.
            self._shared_embed = (shared,)
        self.midlayer = Eagle3Layer(c, bool(hf_config.get("norm_before_residual", False)))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = Linear(c.hidden_size, self.draft_vocab_size, bias=False)
        # Published drafters say max_position_embeddings 2048 while their target runs far
        # longer: the cos/sin table covers the target's positions too. Frequencies come
        # from the drafter's own rope fields (a yarn factor is pinned to its own length).
        params = dict(c.rope_params)
        if params["rope_type"] == "yarn" and params.get("factor") is None:
            params["factor"] = (c.max_position_embeddings
                                / params["original_max_position_embeddings"])
        max_pos = max(c.max_position_embeddings, getattr(tc, "max_position_embeddings", 0))
        self.rotary = RotaryEmbedding(c.head_dim, c.rotary_dim, max_pos, params)
        # Identity maps until loaded (a drafter over the full vocabulary ships none).
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.long))
        t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
        t2d[:self.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # ---- EagleStyleDrafter ------------------------------------------------------------
    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return self.fc(target_hidden)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        embed = self.embed_tokens if self.embed_tokens is not None else self._shared_embed[0]
        emb = embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, emb.dtype)
        r = self.midlayer(emb, hidden, cos, sin, self.rotary, meta)
        return self.norm(r), r

    def write_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """The K/V forward would write for these rows, and nothing else: about a third of
        a forward's work (no attention, o_proj, MLP or norm)."""
        embed = self.embed_tokens if self.embed_tokens is not None else self._shared_embed[0]
        emb = embed(input_ids)
        cos, sin = self.rotary.cos_sin(positions, emb.dtype)
        self.midlayer.write_kv(emb, hidden, cos, sin, self.rotary, meta)

    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """[R, H] -> [R, draft_vocab_size] logits over *draft* ids."""
        return self.lm_head(out)

    def draft_token_ids(self, out: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(out).argmax(dim=-1)
        return draft + self.d2t[draft]

    def attention_layers(self) -> list[PagedAttention]:
        return [self.midlayer.self_attn.attn]


# ---- loading ------------------------------------------------------------------------
def _checkpoint(path: str):
    """(tensor names, a fresh iterator of (name, tensor)). safetensors as the target's
    loader finds them; else a pytorch_model.bin (some published drafters ship only that)."""
    try:
        files = safetensors_files(path)
    except FileNotFoundError:
        binary = os.path.join(path, "pytorch_model.bin")
        if not os.path.exists(binary):
            raise FileNotFoundError(f"no .safetensors weights or pytorch_model.bin in {path}") \
                from None
        state = torch.load(binary, map_location="cpu", weights_only=True, mmap=True)
        return list(state), lambda: iter(state.items())
    names = []
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.extend(st.keys())

    def tensors():
        for f in files:
            with safe_open(f, framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name)
    return names, tensors


def load_eagle3_drafter(path: str, target: nn.Module, dtype: torch.dtype,
                        device: torch.device, platform) -> Eagle3DraftModel:
    """Build the drafter of the EAGLE-3 folder `path` for `target` and fill every weight
    (a missing or unknown tensor is an error naming it). `platform` (the engine's):
    its prepare_model hands the drafter the same kernels as the target.
    """
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    # A drafter places no quantized layers (yet): every quantized format is refused.
    check_quantization(hf_config, f"EAGLE-3 draft {path}", implemented=())
    names, tensors = _checkpoint(path)
    own_embedding = any(n.removeprefix("model.") == "embed_tokens.weight" for n in names)
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Eagle3DraftModel(hf_config, target, own_embedding)
    finally:
        torch.set_default_dtype(torch_default)
    _fill(model, path, tensors())
    platform.prepare_model(model)
    return model.eval().requires_grad_(False)


def _layer_name(name: str) -> str:
    """`[model.]layers.0.X` -> `midlayer.X` (the two namings of published heads)."""
    bare = name.removeprefix("model.")
    return "midlayer." + bare[len("layers.0."):] if bare.startswith("layers.0.") else name


def _fill(model: Eagle3DraftModel, path: str, tensors) -> None:
    params = dict(model.named_parameters())
    filled: set[str] = set()
    shards: dict[str, dict[int, torch.Tensor]] = {}  # packed parameter -> shards so far
    unknown, maps = [], {}
    for ckpt_name, tensor in tensors:
        if ckpt_name.endswith(UNUSED_TENSOR_SUFFIXES):  # recomputed, never learned
            continue
        name, shard = _param_name(_layer_name(ckpt_name), PACKED)
        if name in ("d2t", "t2d"):
            maps[name] = tensor
        elif name not in params:
            unknown.append(ckpt_name)
        elif shard is None:
            if name == "fc.weight":
                _check_fc(model, tensor, path)
            _copy(params[name], tensor, ckpt_name)
            filled.add(name)
        else:
            got = shards.setdefault(name, {})
            got[shard] = tensor
            short = name.rsplit(".", 2)[-2]
            if len(got) == sum(1 for t, _ in PACKED.values() if t == short):
                _copy(params[name], torch.cat([got[i] for i in sorted(got)]), name)
                filled.add(name)
    missing = []
    for name in params:
        if name in filled:
            continue
        # A packed parameter is missing as the checkpoint names its absent shards.
        *module, short, leaf = name.split(".")
        sources = [src for src, (t, s) in PACKED.items()
                   if t == short and s not in shards.get(name, {})]
        missing += [".".join([*module, src, leaf]) for src in sources] or [name]
    if model.draft_vocab_size != model.config.vocab_size and "d2t" not in maps:
        missing.append("d2t")
    if unknown or missing:
        raise ValueError(f"EAGLE-3 checkpoint {path}: " + "; ".join(
            part for part in (f"lacks {missing}" if missing else "",
                              f"has tensors the drafter has no place for: {unknown}"
                              if unknown else "") if part))
    set_vocab_maps(model, maps, path)


def _check_fc(model: Eagle3DraftModel, fc: torch.Tensor, path: str) -> None:
    n, h_t = len(model.aux_layer_ids), model.target_hidden_size
    if fc.dim() != 2 or fc.shape[1] != n * h_t:
        raise ValueError(f"EAGLE-3 checkpoint {path}: fc.weight is {tuple(fc.shape)}, but its "
                         f"input is {n} target hidden states of {h_t} (aux layers "
                         f"{list(model.aux_layer_ids)}): {n * h_t} wide - a drafter for "
                         f"another target?")


def set_vocab_maps(model: nn.Module, maps: dict, path: str, kind: str = "EAGLE-3") -> None:
    """Check a reduced draft vocabulary's maps (`d2t`: draft id -> target id offsets;
    `t2d`, optional: which target ids have a draft id) and copy them into `model`'s
    `d2t` / `t2d` buffers (EAGLE-3 and DFlash heads)."""
    v, dv = model.config.vocab_size, model.draft_vocab_size
    if "d2t" in maps:
        d2t = maps["d2t"]
        if d2t.shape != (dv,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
            raise ValueError(f"{kind} checkpoint {path}: d2t must be [{dv}] integers, got "
                             f"{tuple(d2t.shape)} {d2t.dtype}")
        target_ids = torch.arange(dv) + d2t.long()
        if int(target_ids.min()) < 0 or int(target_ids.max()) >= v:
            raise ValueError(f"{kind} checkpoint {path}: d2t maps draft ids outside the "
                             f"target vocabulary (0..{v - 1})")
        model.d2t.copy_(d2t)
    t2d = torch.zeros(v, dtype=torch.bool)
    t2d[torch.arange(dv) + model.d2t.cpu()] = True
    if "t2d" in maps and not torch.equal(maps["t2d"].bool(), t2d):
        # t2d only restates d2t (which target ids have a draft id); a mismatch is a broken file.
        raise ValueError(f"{kind} checkpoint {path}: t2d does not mark exactly the "
                         f"target ids d2t maps to")
    model.t2d.copy_(t2d)
