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


class _Headless:
    """A decoder saved without its LM head (HF's bare `*Model` classes, how embedding
    models such as Qwen3-Embedding are stored: `Qwen3Model`, weights without the
    `model.` prefix - the loader strips it anyway - and no lm_head): the causal LM's
    model with `lm_head` None. It pools (the runner's pooling rows read the final
    normed hidden states) and never samples."""

    has_lm_head = False
    plain_lm_head = False

    def __init__(self, hf_config: dict):
        super().__init__(hf_config)
        self.lm_head = None  # (a family that built one anyway: dropped before loading)

    def compute_logits(self, hidden):
        raise RuntimeError(f"{type(self).__name__} has no LM head: it only pools")


def _headless_class(arch: str) -> type[nn.Module] | None:
    """`arch` = "{X}Model" (or Gemma's "{X}TextModel") whose "{X}ForCausalLM" tokenmill
    loads: that class without its LM head."""
    if not arch.endswith("Model") or "For" in arch:
        return None
    stems = [arch[:-len("Model")]]
    if arch.endswith("TextModel"):
        stems.append(arch[:-len("TextModel")])
    for stem in stems:
        causal = MODEL_REGISTRY.get(stem + "ForCausalLM")
        if causal is not None:
            return type(arch, (_Headless, causal), {"__module__": __name__})
    return None


def resolve_model_class(hf_config: dict) -> type[nn.Module]:
    archs = hf_config.get("architectures") or []
    for arch in archs:
        if arch in MODEL_REGISTRY:
            return MODEL_REGISTRY[arch]
        headless = _headless_class(arch)
        if headless is not None:
            return headless
    raise ValueError(f"architectures {archs} not supported; supported architectures: "
                     f"{', '.join(supported_architectures())} (and each *ForCausalLM's "
                     f"bare *Model, without its LM head, for pooling)")
