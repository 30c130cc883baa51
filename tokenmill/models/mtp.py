"""The MTP (multi-token prediction) head of Qwen3-Next / Qwen3.5 checkpoints, as a drafter.

The target checkpoint carries it under `mtp.*` (`mtp_num_hidden_layers` in the
config, 1 in every released model): `fc` [H, 2H], `pre_fc_norm_embedding`,
`pre_fc_norm_hidden`, `layers.0` (one full-attention decoder layer built exactly
like the target's: gated attention, q/k norms, partial rotary, and the target's
MLP kind: sparse MoE with a gated shared expert, or dense) and `norm`. The
embedding and the lm_head are the target's.

One draft step over T rows (see spec_decode/draft_model.py for which rows):

    e = pre_fc_norm_embedding(embed(input_ids));  h = pre_fc_norm_hidden(hidden)
    x = fc(cat([e, h]));  x = layers[0](x);  out = norm(x)

`hidden` of the first step is the target's final hidden state (after its last
norm); later steps take `out` of the step before: as in vLLM, the *normed* MTP
output is fed back, so next_hidden is out itself. Every norm is zero-centred
(scales by 1 + weight), as everywhere in these models.
"""
from __future__ import annotations

import copy
import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.config import flatten_text_config
from tokenmill.models.layers.attention import PagedAttention
from tokenmill.models.layers.linear import Linear
from tokenmill.models.checkpoint_io import safetensors_files
from tokenmill.models.loader import load_weights
from tokenmill.models.qwen3_next import (HybridDecoderLayer, Qwen3NextForCausalLM,
                                         ZeroCenteredRMSNorm)

logger = logging.getLogger(__name__)

# Text checkpoints keep the head at the top level; some exports nest it under model.
MTP_PREFIXES = ("mtp.", "model.mtp.")


class MtpDraftModel(nn.Module):
    """An EagleStyleDrafter (spec_decode/draft_model.py) over the target's MTP weights."""

    aux_layer_ids = None  # reads the target's final (normed) hidden state
    # Drafts are argmax of the target's own lm_head: the runner's exact greedy head
    # (int8-screened, layers/greedy_head.py) may stand in for draft_token_ids.
    shares_target_lm_head = True
    packed_modules = Qwen3NextForCausalLM.packed_modules
    expert_modules = Qwen3NextForCausalLM.expert_modules

    def __init__(self, target: Qwen3NextForCausalLM, hf_config: dict):
        super().__init__()
        n = flatten_text_config(hf_config).get("mtp_num_hidden_layers")
        if n != 1:
            # vLLM runs layer (step % n) at draft step `step`; the drafter interface has no
            # step index, and no released checkpoint has more than one layer.
            raise ValueError(f"mtp_num_hidden_layers must be 1, got {n!r}")
        # The MTP layer is the target's full-attention layer code, on a config that says
        # "one full-attention layer, sparse iff the target has experts" (mlp_only_layers
        # and decoder_sparse_step index the target's own layers, not this one).
        c = self.config = copy.copy(target.config)
        c.num_layers, c.layer_types = n, ["full_attention"] * n
        c.mlp_only_layers, c.decoder_sparse_step = [], 1
        # Not a submodule: the target's embedding and lm_head are not the drafter's
        # parameters (the loader must not look for them under mtp.*).
        object.__setattr__(self, "target", target)
        h = c.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = ZeroCenteredRMSNorm(h, c.rms_norm_eps)
        self.pre_fc_norm_hidden = ZeroCenteredRMSNorm(h, c.rms_norm_eps)
        self.layers = nn.ModuleList(HybridDecoderLayer(c, i, shared_expert_gate=True)
                                    for i in range(n))
        self.norm = ZeroCenteredRMSNorm(h, c.rms_norm_eps)

    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        e = self.pre_fc_norm_embedding(self.target.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        rotary = self.target.rotary  # same head_dim, partial rotary and rope scaling
        cos, sin = rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, rotary, meta)
        out = self.norm(x)
        return out, out

    def write_kv(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        """Only the K/V forward would write (its one layer's: no attention, MLP or norm)."""
        e = self.pre_fc_norm_embedding(self.target.embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        rotary = self.target.rotary
        cos, sin = rotary.cos_sin(positions, x.dtype)
        layer = self.layers[0]
        layer.self_attn.write_kv(layer.input_layernorm(x), cos, sin, rotary, meta)

    def draft_token_ids(self, out: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(out).argmax(dim=-1)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]


def mtp_tensor_names(path: str) -> list[str]:
    """The checkpoint names of the MTP head (headers only: no tensor is read)."""
    names = []
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            names += [n for n in f.keys() if n.startswith(MTP_PREFIXES)]
    return names


def _mtp_tensors(path: str):
    """(name without the mtp prefix, tensor) for the MTP tensors only: the target's
    weights, already loaded, are not read again."""
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                prefix = next((p for p in MTP_PREFIXES if name.startswith(p)), None)
                if prefix is not None:
                    yield name[len(prefix):], f.get_tensor(name)


def load_mtp_drafter(path: str, target: nn.Module, dtype: torch.dtype, device: torch.device,
                     platform) -> MtpDraftModel:
    """The MTP drafter of the target loaded from `path` (the target's own folder), with the
    platform's kernel decisions applied as for the target (see loader.load_model)."""
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    text = flatten_text_config(hf_config)
    # (under tensor parallelism, rank 0's view of its shard: spec_decode/loading.py)
    if not isinstance(getattr(target, "sharded_target", target), Qwen3NextForCausalLM):
        raise ValueError(f"speculative_config.method 'mtp' needs a Qwen3-Next / Qwen3.5 or "
                         f"DeepSeek-V3 target; checkpoint {path} is "
                         f"{text.get('architectures')}")
    if not text.get("mtp_num_hidden_layers"):
        raise ValueError(f"checkpoint {path} has no MTP head: its config sets no "
                         f"mtp_num_hidden_layers")
    if text["mtp_num_hidden_layers"] != 1:
        raise ValueError(f"checkpoint {path}: mtp_num_hidden_layers must be 1, got "
                         f"{text['mtp_num_hidden_layers']!r} (see MtpDraftModel)")
    if not mtp_tensor_names(path):
        raise ValueError(f"checkpoint {path} has no MTP weights (no mtp.* tensors), although "
                         f"its config sets mtp_num_hidden_layers="
                         f"{text['mtp_num_hidden_layers']}")
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            drafter = MtpDraftModel(target, hf_config)
    finally:
        torch.set_default_dtype(torch_default)
    try:
        load_weights(drafter, path, tensors=_mtp_tensors(path))
    except ValueError as e:
        raise ValueError(f"MTP weights of checkpoint {path} (mtp.*; the names below drop "
                         f"that prefix): {e}") from None
    platform.prepare_model(drafter)
    logger.info("MTP drafter: %d layer(s) from %s", len(drafter.layers), path)
    return drafter.eval().requires_grad_(False)
