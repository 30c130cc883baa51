"""Checkpoint weight names shared by several model families."""
from __future__ import annotations

# Where vision-language checkpoints keep their language model's weights (transformers 5
# in memory; the hub's files, written by transformers 4), and what the text model names them.
TEXT_MODEL_PREFIXES = (("model.language_model.", "model."), ("language_model.model.", "model."),
                       ("language_model.lm_head.", "lm_head."), ("language_model.", "model."))


def text_model_name(name: str) -> str:
    """A vision-language checkpoint's language-model weight name as its text model
    names it (any other name unchanged)."""
    for prefix, to in TEXT_MODEL_PREFIXES:
        if name.startswith(prefix):
            return to + name[len(prefix):]
    return name
