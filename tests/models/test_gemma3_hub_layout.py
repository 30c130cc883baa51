"""Gemma 3 vision-language checkpoints (Gemma3ForConditionalGeneration, as gemma-3-4b/12b/27b
are on the hub) load as text models: the vision tower is skipped, the text weights come
from either file layout, and a text_config that omits fields at their defaults reads as
transformers' config class reads it."""
from __future__ import annotations

import json
import os
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import hf_greedy, make_prompts

TEXT = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=4, head_dim=16, sliding_window=12,
            sliding_window_pattern=2, max_position_embeddings=256,
            final_logit_softcapping=30.0)
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
              image_size=28, patch_size=14)
# Fields of the text_config at Gemma3TextConfig's defaults: a hub config.json leaves them out.
AT_DEFAULTS = ("num_attention_heads", "num_key_value_heads", "query_pre_attn_scalar",
               "rms_norm_eps", "rope_parameters", "layer_types", "hidden_activation")


@pytest.fixture(scope="module")
def gemma3_vl(tmp_path_factory):
    import transformers as tf
    path = str(tmp_path_factory.mktemp("gemma3_vl") / "ckpt")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = tf.Gemma3Config(text_config=TEXT, vision_config=VISION, mm_tokens_per_image=4,
                              image_token_index=383, boi_token_index=381, eoi_token_index=382)
        model = tf.Gemma3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.2 * torch.randn_like(p))  # Gemma norms scale by (1 + w)
    model.save_pretrained(path)
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    for key in AT_DEFAULTS:
        raw["text_config"].pop(key, None)
    with open(cfg_path, "w") as f:
        json.dump(raw, f)
    return path, model


def test_text_config_is_completed_from_the_class_defaults():
    """gemma-3-4b-it's text_config as the hub has it: the head counts, head_dim and
    vocab come from Gemma3TextConfig; rope and token ids are not filled in."""
    from tokenmill.config import flatten_text_config
    hub = {"architectures": ["Gemma3ForConditionalGeneration"], "eos_token_id": [1, 106],
           "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                           "model_type": "gemma3_text", "num_hidden_layers": 34,
                           "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                           "sliding_window": 1024}}
    flat = flatten_text_config(hub)
    assert (flat["num_attention_heads"], flat["num_key_value_heads"], flat["head_dim"],
            flat["vocab_size"], flat["query_pre_attn_scalar"]) == (8, 4, 256, 262208, 256)
    assert flat["eos_token_id"] == [1, 106]  # the outer config's, not the class default
    assert "rope_parameters" not in flat and flat["rope_scaling"]["factor"] == 8.0
    assert flat["layer_types"].count("full_attention") == 5  # every 6th of 34
    from tokenmill.models.gemma3 import FULL, Gemma3Config
    c = Gemma3Config(flat)
    assert c.rope[FULL]["rope_type"] == "linear" and c.rope[FULL]["rope_theta"] == 1e6


@pytest.mark.parametrize("layout", ["hub", "transformers5"])
def test_vl_checkpoint_generates_hf_text(gemma3_vl, layout, tmp_path):
    """Greedy tokens equal HF's Gemma3ForConditionalGeneration on text prompts (fp32),
    a prompt past the window, chunked prefill; both weight-name layouts."""
    from tokenmill import LLM, SamplingParams
    path, hf = gemma3_vl
    if layout == "transformers5":  # the names transformers 5 keeps in memory
        moved = str(tmp_path / "t5")
        os.makedirs(moved)
        for name in os.listdir(path):
            if not name.endswith(".safetensors"):
                os.symlink(os.path.join(path, name), os.path.join(moved, name))
        tensors = load_file(os.path.join(path, "model.safetensors"))
        renamed = {}
        for k, v in tensors.items():
            for old, new in (("language_model.model.", "model.language_model."),
                             ("vision_tower.", "model.vision_tower."),
                             ("multi_modal_projector.", "model.multi_modal_projector.")):
                if k.startswith(old):
                    k = new + k[len(old):]
                    break
            renamed[k] = v
        assert any(k.startswith("model.language_model.") for k in renamed)
        save_file(renamed, os.path.join(moved, "model.safetensors"), metadata={"format": "pt"})
        path = moved
    llm = LLM(path, dtype="float32", device="cpu", block_size=8, max_num_batched_tokens=16,
              enable_chunked_prefill=True)
    assert type(llm.llm_engine.model_config.hf_config["num_attention_heads"]) is int
    prompts = make_prompts([5, 40, 17], 380)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(hf, p, 12) for p in prompts]
