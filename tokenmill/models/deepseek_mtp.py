"""The MTP (multi-token prediction) module of DeepSeek-V3 checkpoints, as a drafter.

A V3 checkpoint carries `num_nextn_predict_layers` (1 in the released models) extra
layers after its decoder, as `model.layers.{N}.*` with N = num_hidden_layers (the
target drops them: DeepseekV2ForCausalLM.map_checkpoint). Besides one decoder layer
built exactly like the target's layer N (MLA attention; an MoE MLP where the config
makes layer N sparse), the block holds `enorm` and `hnorm` (RMSNorms of the token
embedding and of the incoming hidden state), `eh_proj` [H, 2H], and `shared_head`
(`norm`, and `head`: its own copy of the output projection). Its `embed_tokens` copy
is the target's embedding, which it shares.

One draft step over T rows (spec_decode/draft_model.py says which rows):

    e = enorm(embed(input_ids)), zero where the position is 0;  h = hnorm(hidden)
    x = layer(eh_proj(cat([e, h])));  out = shared_head.norm(x);  logits = head(out)

The first step's `hidden` is the target's final hidden state (after its last norm);
later steps take `x`, the block's output before shared_head's norm, as vLLM chains
them. The row at position 0 pairs the first hidden state with the second token, a
pair the module never saw in training: its embedding is zeroed, as vLLM does.
"""
from __future__ import annotations

import json
import logging
import os

import torch
from safetensors import safe_open
from torch import nn

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.models.checkpoint_io import checkpoint_header, safetensors_files
from tokenmill.models.deepseek_v2 import DecoderLayer, DeepseekV2ForCausalLM
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.norm import RMSNorm
from tokenmill.models.loader import load_weights

logger = logging.getLogger(__name__)

# The block's own tensors (everything else under the prefix is its decoder layer's).
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.")


class SharedHead(nn.Module):
    def __init__(self, hidden: int, vocab: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(hidden, eps)
        self.head = Linear(hidden, vocab, bias=False)


class DeepseekMtpDraftModel(nn.Module):
    """An EagleStyleDrafter (spec_decode/draft_model.py) over a V3 checkpoint's MTP block."""

    aux_layer_ids = None  # reads the target's final (normed) hidden state
    packed_modules = DeepseekV2ForCausalLM.packed_modules
    expert_modules = DeepseekV2ForCausalLM.expert_modules

    def __init__(self, target: DeepseekV2ForCausalLM):
        super().__init__()
        c = target.config
        # Not a submodule: the target's embedding and rotary are not the drafter's
        # parameters (the loader must not look for them in the MTP block).
        object.__setattr__(self, "target", target)
        h = c.hidden_size
        self.enorm = RMSNorm(h, c.rms_norm_eps)
        self.hnorm = RMSNorm(h, c.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h, bias=False)
        # Built as the target's layer N would be: sparse or dense as the config says.
        self.layers = nn.ModuleList([DecoderLayer(c, c.num_layers)])
        self.shared_head = SharedHead(h, c.vocab_size, c.rms_norm_eps)

    def combine_target_hidden(self, target_hidden: torch.Tensor) -> torch.Tensor:
        return target_hidden

    def _block(self, input_ids, positions, hidden, meta) -> torch.Tensor:
        e = self.target.embed_tokens(input_ids)
        e = e.masked_fill((positions == 0)[:, None], 0.0)
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden)], dim=-1))
        rotary = self.target.rotary  # the target's rope (YaRN scaling included)
        cos, sin = rotary.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, rotary, meta)
        return x

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = self._block(input_ids, positions, hidden, meta)
        return self.shared_head.norm(x), x

    def draft_token_ids(self, out: torch.Tensor) -> torch.Tensor:
        return self.shared_head.head(out).argmax(dim=-1)

    def attention_layers(self):
        return [layer.self_attn.attn for layer in self.layers]

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """Block names (prefix removed) -> this module's: the decoder layer's become
        layers.0.* and take the target's mapping (MLA rope rows reordered); the embedding
        copy is the target's and is dropped."""
        if name.startswith("embed_tokens."):
            return
        if name.startswith(OWN):
            yield name, tensor
            return
        yield from self.target.map_checkpoint("layers.0." + name, tensor)


def _prefix(text: dict) -> str:
    return f"model.layers.{text['num_hidden_layers']}."


def _block_tensors(path: str, prefix: str):
    for file in safetensors_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                if name.startswith(prefix):
                    yield name[len(prefix):], f.get_tensor(name)


def load_deepseek_mtp_drafter(path: str, target: nn.Module, dtype: torch.dtype,
                              device: torch.device, platform) -> DeepseekMtpDraftModel:
    """The MTP drafter of the DeepSeek-V3 target loaded from `path` (its own folder)."""
    with open(os.path.join(path, "config.json")) as f:
        hf_config = json.load(f)
    n = hf_config.get("num_nextn_predict_layers") or 0
    if n == 0:
        raise ValueError(f"checkpoint {path} has no MTP layers: its config sets no "
                         f"num_nextn_predict_layers")
    if n != 1:
        # vLLM runs layer (step % n) at draft step `step`; the drafter interface has no
        # step index, and the released checkpoints have one.
        raise ValueError(f"checkpoint {path}: num_nextn_predict_layers must be 1, got {n!r}")
    prefix = _prefix(hf_config)
    header = {k: v for k, v in checkpoint_header(path).items() if k.startswith(prefix)}
    if not header:
        raise ValueError(f"checkpoint {path} has no MTP weights (no {prefix}* tensors), "
                         f"although its config sets num_nextn_predict_layers={n}")
    if hf_config.get("quantization_config"):
        # Quantized layers are placed from the checkpoint's header under the target's
        # names; the block's live under another prefix (not mapped yet).
        raise ValueError(f"checkpoint {path}: method 'mtp' with a quantized DeepSeek "
                         f"checkpoint (quantization_config "
                         f"{hf_config['quantization_config'].get('quant_method')!r}) is not "
                         f"implemented")
    torch_default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            drafter = DeepseekMtpDraftModel(target)
    finally:
        torch.set_default_dtype(torch_default)
    try:
        load_weights(drafter, path, tensors=_block_tensors(path, prefix))
    except ValueError as e:
        raise ValueError(f"MTP weights of checkpoint {path} ({prefix}*; the names below "
                         f"drop that prefix): {e}") from None
    platform.prepare_model(drafter)
    logger.info("DeepSeek MTP drafter: 1 layer from %s", path)
    return drafter.eval().requires_grad_(False)
