"""Tiny embedding checkpoints for the embedding tests: a random HF `Qwen3Model` (the
decoder without its LM head, as Qwen3-Embedding is saved) with the sentence-transformers
files written here, and HF's own pooling as the reference."""
from __future__ import annotations

import json
import os
import shutil
import warnings

import torch
import torch.nn.functional as F

from conftest import TINY

ST_MODES = {"LAST": "pooling_mode_lasttoken", "MEAN": "pooling_mode_mean_tokens",
            "CLS": "pooling_mode_cls_token"}


def write_st_files(path: str, mode: str | None = "LAST", normalize: bool = True,
                   extra_modules: tuple = (), pooling_config: dict | None = None) -> None:
    """modules.json (Transformer -> Pooling -> [Normalize]) and 1_Pooling/config.json, as
    sentence-transformers saves them; `mode` None: no Pooling module at all."""
    modules = [{"idx": 0, "name": "0", "path": "",
                "type": "sentence_transformers.models.Transformer"}]
    if mode is not None:
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling",
                        "type": "sentence_transformers.models.Pooling"})
        cfg = {"word_embedding_dimension": 64, "pooling_mode_cls_token": False,
               "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False,
               "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "pooling_mode_lasttoken": False,
               "include_prompt": True}
        cfg[ST_MODES[mode]] = True
        cfg.update(pooling_config or {})
        os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
        with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
            json.dump(cfg, f)
    if normalize:
        modules.append({"idx": len(modules), "name": str(len(modules)),
                        "path": f"{len(modules)}_Normalize",
                        "type": "sentence_transformers.models.Normalize"})
    for t in extra_modules:
        modules.append({"idx": len(modules), "name": str(len(modules)), "path": "x",
                        "type": t})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)


def build_qwen3_embedding(path: str, seed: int = 0, tokenizer_from: str | None = None,
                          **overrides):
    """A tiny random fp32 HF Qwen3Model saved to `path` (norms randomised as conftest's
    checkpoints, so a loader that skips them cannot pass); with `tokenizer_from`, that
    folder's tokenizer files copied in (the vocabulary sized to it). Returns the HF model."""
    import transformers as tf
    kw = dict(TINY, **overrides)
    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = tf.Qwen3Model(tf.Qwen3Config(**kw)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
    model.save_pretrained(path)
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            shutil.copy(os.path.join(tokenizer_from, name), os.path.join(path, name))
    return model


@torch.inference_mode()
def hf_pooled(decoder, ids: list[int], kind: str = "LAST", normalize: bool = True):
    """HF's pooling of one prompt over a bare decoder's last_hidden_state (the final
    normed hidden states), in float32."""
    h = decoder(torch.tensor([ids])).last_hidden_state[0].float()
    vec = {"LAST": h[-1], "MEAN": h.mean(dim=0), "CLS": h[0]}[kind]
    return F.normalize(vec, p=2, dim=-1) if normalize else vec
