"""Architecture name (config.json "architectures") -> model class."""
from __future__ import annotations

from torch import nn

from tokenmill.models.deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV3ForCausalLM
from tokenmill.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from tokenmill.models.gemma4 import Gemma4ForCausalLM, Gemma4ForConditionalGeneration
from tokenmill.models.llama import (LlamaForCausalLM, MistralForCausalLM, Phi3ForCausalLM,
                                    Qwen2ForCausalLM, Qwen3ForCausalLM)
from tokenmill.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from tokenmill.models.qwen3_vl import Qwen3VLForConditionalGeneration
from tokenmill.models.qwen3_moe import Qwen3MoeForCausalLM
from tokenmill.models.qwen3_5_vl import (Qwen3_5ForConditionalGeneration,
                                         Qwen3_5MoeForConditionalGeneration)
from tokenmill.models.qwen3_next import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM,
                                         Qwen3NextForCausalLM)

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,
    "Gemma4ForCausalLM": Gemma4ForCausalLM,
    "Gemma4ForConditionalGeneration": Gemma4ForConditionalGeneration,
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2_5_VLForConditionalGeneration": Qwen2_5_VLForConditionalGeneration,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen3VLForConditionalGeneration": Qwen3VLForConditionalGeneration,
    "Qwen3NextForCausalLM": Qwen3NextForCausalLM,
    "Qwen3_5ForCausalLM": Qwen3_5ForCausalLM,
    "Qwen3_5MoeForCausalLM": Qwen3_5MoeForCausalLM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5ForConditionalGeneration,
    "Qwen3_5MoeForConditionalGeneration": Qwen3_5MoeForConditionalGeneration,
}


def supported_architectures() -> list[str]:
    return sorted(MODEL_REGISTRY)


def resolve_model_class(hf_config: dict) -> type[nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
    raise ValueError(f"architectures {archs} not supported; supported architectures: "
                     f"{', '.join(supported_architectures())}")
