"""Engine configuration: the model, the KV cache, the scheduler."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field

import torch

from tokenmill.models.layers.rotary import LONGROPE_USE_LONG, longrope_choice
from tokenmill.models.quantization import check_quantization

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "half": torch.float16, "fp16": torch.float16}


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device must be 'auto', 'cpu' or 'cuda', got {device!r}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, hf_config: dict, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported (float32, bfloat16, float16)")
        return dtype
    if not isinstance(dtype, str):
        raise ValueError(f"dtype must be a string or torch.dtype, got {dtype!r}")
    if dtype == "auto":
        ckpt = hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"
        resolved = _DTYPES.get(ckpt, torch.float32)
        # fp16 on CPU is slow and lossy; bf16 is the CPU's half type (as in vLLM).
        if device.type == "cpu" and resolved == torch.float16:
            resolved = torch.bfloat16
        return resolved
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got {dtype!r}")
    return _DTYPES[dtype]


def flatten_text_config(hf_config: dict) -> dict:
    """A vision-language config keeps its language model's fields in text_config:
    lift them to the top (they win), keep the architectures and the vision part (a
    multimodal model reads it; text-only ones of such checkpoints ignore it)."""
    text = hf_config.get("text_config")
    if not isinstance(text, dict):
        return hf_config
    top = {k: v for k, v in hf_config.items() if k != "text_config"}
    text = complete_text_config(text, given=top)
    return {**top, **text, "architectures": hf_config.get("architectures")}


def complete_text_config(text: dict, given: dict | None = None) -> dict:
    """A hub checkpoint's text_config may hold only the fields that differ from its
    config class's defaults (Gemma 3's omits the head counts, head_dim and vocab_size):
    add the missing ones as transformers' class for its model_type sets them, from the
    fields given, so the model reads what HF's would. Rope fields stay as given (each
    model reads its rope defaults itself), and so do the special token ids and whatever
    `given` (the config around text_config) holds."""
    model_type = text.get("model_type")
    try:
        from transformers import CONFIG_MAPPING, PretrainedConfig
        cls = CONFIG_MAPPING[model_type]
    except (ImportError, KeyError):
        return text
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = cls(**{k: v for k, v in text.items() if k != "model_type"}).to_dict()
        generic = set(PretrainedConfig().to_dict())  # bookkeeping every config has
    given = given or {}
    missing = {k: v for k, v in full.items()
               if k not in text and k not in given and k not in generic and v is not None
               and not k.startswith(("rope", "_")) and not k.endswith("_token_id")}
    return {**missing, **text}


def resolve_model_path(model: str) -> str:
    """A local folder as is; otherwise a hub id fetched with huggingface_hub."""
    if os.path.isdir(model):
        return model
    # A hub id is "name" or "org/name"; anything else is a missing local folder.
    if model.startswith((".", "/", "~")) or model.count("/") > 1:
        raise ValueError(f"model folder {model!r} does not exist")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.txt",
                                                        "*.model", "*.jinja"])
    except Exception as e:  # network errors come in many types
        raise ValueError(f"model {model!r} is not a local folder and could not be fetched "
                         f"from the Hugging Face hub (no network here?): {e}") from e


def sliding_window(hf_config: dict) -> int | None:
    """The positions a query of a sliding-window layer sees, its own included (Mistral,
    Phi-3, Gemma 3's local layers), else None. Qwen2 / Qwen3 configs carry a window they do not use
    (use_sliding_window false)."""
    window = hf_config.get("sliding_window")
    if not window or hf_config.get("use_sliding_window", True) is False:
        return None
    return int(window)


@dataclass
class ModelConfig:
    model: str
    path: str
    hf_config: dict
    dtype: torch.dtype
    device: torch.device
    max_model_len: int
    generation_config: dict = field(default_factory=dict)
    # --quantization: the method an unquantized checkpoint is quantized to at load
    # (models/quantize_at_load.py); None: none, or the checkpoint's own.
    quantization: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.hf_config["vocab_size"]

    @classmethod
    def from_pretrained(cls, model: str, dtype="auto", device="auto",
                        max_model_len: int | None = None,
                        quantization: str | None = None) -> "ModelConfig":
        path = resolve_model_path(model)
        cfg_path = os.path.join(path, "config.json")
        if not os.path.exists(cfg_path):
            raise ValueError(f"model folder {path!r} has no config.json")
        with open(cfg_path) as f:
            raw_config = json.load(f)
        # A quantized format the engine does not implement is refused before anything
        # else is read (its weights would load as noise).
        check_quantization(raw_config, f"model {path}")
        from tokenmill.models.quantize_at_load import resolve_quantization
        quantization = resolve_quantization(quantization, raw_config, f"model {path}")
        hf_config = flatten_text_config(raw_config)
        gen_cfg = {}
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                gen_cfg = json.load(f)
        dev = resolve_device(device)
        limit = hf_config.get("max_position_embeddings", 2048)
        if max_model_len is None:
            max_model_len = limit
        elif not isinstance(max_model_len, int) or max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive int, got {max_model_len!r}")
        elif max_model_len > limit:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's "
                             f"max_position_embeddings {limit}")
        use_long = longrope_choice(hf_config, max_model_len)
        if use_long is not None:
            hf_config = {**hf_config, LONGROPE_USE_LONG: use_long}
            if use_long:
                logger.warning(
                    "LongRoPE: max_model_len %d exceeds the pretraining length, so every "
                    "sequence uses the long rope factors (HF transformers uses the short "
                    "ones for sequences within that length: outputs on short prompts differ "
                    "from its). A max_model_len within original_max_position_embeddings "
                    "picks the short factors.", max_model_len)
        return cls(model, path, hf_config, resolve_dtype(dtype, hf_config, dev), dev,
                   max_model_len, gen_cfg, quantization)

    def eos_token_ids(self, tokenizer=None) -> frozenset[int]:
        ids = set()
        for source in (self.generation_config, self.hf_config):
            eos = source.get("eos_token_id")
            if eos is None:
                continue
            ids.update(eos if isinstance(eos, list) else [eos])
            break
        if not ids and tokenizer is not None and tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        return frozenset(ids)


@dataclass
class CacheConfig:
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    # Share of available memory for the KV cache when neither is given.
    memory_fraction: float = 0.3
    # K/V element type: "auto" (the model's dtype) or "fp8" / "fp8_e4m3" (float8_e4m3fn).
    cache_dtype: str = "auto"
    # Hybrid prefix caching: recurrent-state snapshot slots (None: 4 per sequence, at
    # most a quarter of the KV budget).
    num_state_snapshots: int | None = None
