"""Load the draft model a SpeculativeConfig names (eagle3 and dflash: their own
folder; mtp: the target checkpoint's mtp.* weights); n-gram needs none."""
from __future__ import annotations

from tokenmill.spec_decode.config import SpeculativeConfig


# Drafters that read the target's hidden states between layers (EAGLE-3's aux layers,
# DFlash's target layers).
HIDDEN_STATE_METHODS = ("eagle3", "dflash")


def check_hidden_state_target(method: str, target) -> None:
    """Refused at start: these drafters read hidden states between the target's layers,
    which architectures with `provides_aux_hidden` expose (models/layers/taps.py)."""
    if method in HIDDEN_STATE_METHODS and not getattr(target, "provides_aux_hidden", False):
        raise ValueError(
            f"speculative_config.method {method!r} is not supported for "
            f"{type(target).__name__} targets yet: the drafter reads hidden states between "
            f"the target's layers, which this architecture does not expose (every other "
            f"family does: Llama, Mistral, Phi-3, Qwen2 / Qwen2.5-VL, Qwen3, Qwen3-MoE, "
            f"Qwen3.5 / Qwen3-Next, Gemma 3 / 4, DeepSeek; 'ngram' works everywhere, 'mtp' "
            f"on checkpoints with an MTP head)")


def load_draft_model(spec: SpeculativeConfig | None, model_config, target, platform):
    if spec is None or spec.method == "ngram":
        return None
    dtype, device = model_config.dtype, model_config.device
    check_hidden_state_target(spec.method, target)
    if spec.method == "eagle3":
        from tokenmill.models.eagle3 import load_eagle3_drafter
        return load_eagle3_drafter(spec.model, target, dtype, device, platform)
    if spec.method == "mtp":
        from tokenmill.models.deepseek_v2 import DeepseekV2ForCausalLM
        if isinstance(target, DeepseekV2ForCausalLM):  # V3's model.layers.{N} block
            from tokenmill.models.deepseek_mtp import load_deepseek_mtp_drafter
            return load_deepseek_mtp_drafter(model_config.path, target, dtype, device,
                                             platform)
        from tokenmill.models.mtp import load_mtp_drafter
        return load_mtp_drafter(model_config.path, target, dtype, device, platform)
    if spec.method == "dflash":
        from tokenmill.models.dflash import load_dflash_drafter
        model = load_dflash_drafter(spec.model, target, dtype, device, platform)
        k, block = spec.num_speculative_tokens, model.config.block_size
        if k > block - 1:
            raise ValueError(f"speculative_config.num_speculative_tokens={k}: the DFlash "
                             f"draft was trained on blocks of {block} (at most {block - 1})")
        if model_config.max_model_len > model.config.max_position_embeddings:
            raise ValueError(f"max_model_len {model_config.max_model_len} is longer than the "
                             f"DFlash draft's max_position_embeddings "
                             f"{model.config.max_position_embeddings}")
        return model
    raise ValueError(f"speculative_config.method {spec.method!r} has no draft model loader")


# Draft methods that run under tensor parallelism: their drafter is small, so it runs
# whole on rank 0 (reading the target's hidden states, complete on every rank after
# the row-parallel all-reduces) with the target's embedding / lm_head gathered whole.
# MTP: Qwen3-Next / Qwen3.5 heads (DeepSeek-V3's MTP block is refused by name there).
TP_DRAFT_METHODS = ("eagle3", "dflash", "mtp")


class RankZeroTarget:
    """The target as a draft model on rank 0 sees it under tensor parallelism: its own
    attributes, but the embedding and lm_head whole (gathered at load: the target's own
    are vocabulary shards whose forward is a collective the other ranks would not join)
    and, where given, the whole model's config (an MTP head is built from it)."""

    def __init__(self, target, embed_tokens, lm_head, config=None):
        self.__dict__.update(sharded_target=target, embed_tokens=embed_tokens,
                             lm_head=lm_head, config=config or target.config)

    def __getattr__(self, name):
        return getattr(self.__dict__["sharded_target"], name)

    def compute_logits(self, hidden):
        if not getattr(self.sharded_target, "plain_lm_head", False):
            raise ValueError("a draft model under tensor parallelism needs a target whose "
                             "logits are its lm_head's (no soft-capping or scaling)")
        return self.lm_head(hidden)


def load_rank_zero_draft_model(spec: SpeculativeConfig, model_config, target, platform):
    """Rank 0's draft model under tensor parallelism (`target`: rank 0's shard, loaded
    with whole_vocab_io)."""
    if spec.method not in TP_DRAFT_METHODS:
        raise ValueError(f"speculative_config.method {spec.method!r} does not run under "
                         f"tensor parallelism")
    config = None
    if spec.method == "mtp":
        from tokenmill.config import flatten_text_config
        from tokenmill.models.qwen3_next import Qwen3NextForCausalLM
        if not isinstance(target, Qwen3NextForCausalLM):
            raise ValueError(f"speculative_config.method 'mtp' with tensor_parallel_size > 1 "
                             f"needs a Qwen3-Next / Qwen3.5 target (DeepSeek-V3's MTP block "
                             f"is not run under tensor parallelism), not "
                             f"{type(target).__name__}")
        # The head's layer is whole: built from the checkpoint's config, not the rank's.
        config = type(target.config)(flatten_text_config(model_config.hf_config))
        if target.force_norm_topk:  # (as the model class sets it on its own config)
            config.norm_topk_prob = True
    return load_draft_model(spec, model_config,
                            RankZeroTarget(target, *target.whole_vocab_io, config), platform)
