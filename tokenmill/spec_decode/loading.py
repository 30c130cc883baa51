"""Load the draft model a SpeculativeConfig names (eagle3: its own folder; mtp: the
target checkpoint's mtp.* weights); n-gram needs none."""
from __future__ import annotations

from tokenmill.spec_decode.config import SpeculativeConfig


def load_draft_model(spec: SpeculativeConfig | None, model_config, target, platform=None):
    if spec is None or spec.method == "ngram":
        return None
    dtype, device = model_config.dtype, model_config.device
    if spec.method == "eagle3":
        from tokenmill.models.eagle3 import load_eagle3_drafter
        return load_eagle3_drafter(spec.model, target, dtype, device, platform)
    if spec.method == "mtp":
        from tokenmill.models.mtp import load_mtp_drafter
        return load_mtp_drafter(model_config.path, target, dtype, device, platform)
    raise ValueError(f"speculative_config.method {spec.method!r} has no draft model loader")
