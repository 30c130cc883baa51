"""Qwen3.5 / Qwen3.5-MoE vision-language checkpoints (Qwen3_5ForConditionalGeneration,
Qwen3_5MoeForConditionalGeneration): the hybrid text model of qwen3_next.py (Gated
DeltaNet + gated attention layers) under Qwen3-VL's vision tower, without DeepStack.

Tower: Qwen3-VL's (patch embedding with bias, the learned position grid resampled to
each image, LayerNorm blocks with full attention per frame and the 2-D rotary, the
merger); its merged rows replace the image placeholders' embeddings and nothing is
added after the first decoder layers. Text model: the attention layers rotate by
interleaved M-RoPE over their partial rotary dims (the reference's sections default
to [11, 11, 10]); the Gated DeltaNet layers take no positions, so the images reach
them through the embeddings only.
"""
from __future__ import annotations

import torch

from tokenmill.models.qwen2_5_vl import VisionLanguageMixin, mrope_text_config
from tokenmill.models.qwen3_next import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                                         Qwen3NextForCausalLM)
from tokenmill.models.qwen3_vl import Qwen3VisionConfig, Qwen3VisionModel

# The reference's sections when the text config names none.
DEFAULT_MROPE_SECTION = [11, 11, 10]


class Qwen3_5VisionMixin(VisionLanguageMixin):
    def __init__(self, hf_config: dict):
        super().__init__(mrope_text_config(hf_config))
        vision = Qwen3VisionConfig(self.vision_config(hf_config))
        vision.deepstack_visual_indexes = []  # Qwen3.5's tower has no DeepStack taps
        self.init_vision(hf_config, Qwen3VisionModel(vision), interleaved=True,
                         default_section=DEFAULT_MROPE_SECTION)

    def map_checkpoint(self, name: str, tensor: torch.Tensor):
        """The tower's tensors (model.visual.* or visual.*) to `visual`; the text
        model's (and the skipped MTP head's) as the hybrid text model maps them."""
        if name.startswith("model.visual."):
            yield name[len("model."):], tensor
        elif name.startswith("visual."):
            yield name, tensor
        else:
            yield from Qwen3NextForCausalLM.map_checkpoint(self, name, tensor)


class Qwen3_5ForConditionalGeneration(Qwen3_5VisionMixin, Qwen3_5ForCausalLM):
    pass


class Qwen3_5MoeForConditionalGeneration(Qwen3_5VisionMixin, Qwen3_5MoeForCausalLM):
    pass
