"""LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini): the engine's factor set follows max_model_len.

HF transformers picks short or long factors by the current sequence length; the engine
picks one set for its lifetime (long iff max_model_len > original_max_position_embeddings).
Both agree wherever HF's choice is the engine's: sequences within the pretraining length
with a short engine, and prompts already past it with a long one.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from conftest import TinyModel, build_checkpoint, hf_greedy, hf_next_token, make_prompts

ORIG = 64  # original_max_position_embeddings of the tiny checkpoints (max_position 256)
ROTARY_PAIRS = 6  # head_dim 16 x partial_rotary_factor 0.75 = 12 rotated features


def _factors(seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 3.0 * torch.rand(ROTARY_PAIRS, generator=g)).tolist()


LONGROPE = {"rope_type": "longrope", "short_factor": _factors(1), "long_factor": _factors(2)}


def _phi3_config(**scaling):
    from transformers import Phi3Config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Phi3Config(vocab_size=64, hidden_size=64, intermediate_size=32,
                          num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                          max_position_embeddings=256, original_max_position_embeddings=ORIG,
                          partial_rotary_factor=0.75,
                          rope_parameters={"rope_theta": 10000.0, **LONGROPE, **scaling})


@pytest.mark.parametrize("use_long", [False, True])
@pytest.mark.parametrize("scaling", [{}, {"attention_factor": 1.25}], ids=["derived", "given"])
def test_inv_freq_and_scale_match_hf(use_long, scaling):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from tokenmill.models.layers.rotary import (LONGROPE_USE_LONG, compute_inv_freq,
                                                rope_parameters_from_config)
    cfg = _phi3_config(**scaling)
    hf_inv, hf_scale = ROPE_INIT_FUNCTIONS["longrope"](cfg, None,
                                                      seq_len=ORIG + 1 if use_long else None)
    for source in (cfg.to_dict(),  # what HF writes, and a transformers 4 config.json
                   {"rope_theta": 10000.0, "max_position_embeddings": 256,
                    "original_max_position_embeddings": ORIG, "partial_rotary_factor": 0.75,
                    "rope_scaling": {"type": "su", "short_factor": LONGROPE["short_factor"],
                                     "long_factor": LONGROPE["long_factor"], **scaling}}):
        params = rope_parameters_from_config({**source, LONGROPE_USE_LONG: use_long})
        inv, scale = compute_inv_freq(params, 12, 256)
        torch.testing.assert_close(inv, hf_inv.float(), rtol=1e-6, atol=0)
        assert scale == pytest.approx(hf_scale, rel=1e-9)
    if not scaling:  # Phi-3's default: sqrt(1 + ln(256 / 64) / ln(64))
        assert hf_scale == pytest.approx(math.sqrt(1 + math.log(4) / math.log(ORIG)))


def test_bad_factors_are_refused():
    from tokenmill.models.layers.rotary import compute_inv_freq, rope_parameters_from_config
    with pytest.raises(ValueError, match="long_factor"):
        rope_parameters_from_config({"rope_parameters": {"rope_type": "longrope",
                                                         "short_factor": [1.0] * 6}})
    params = rope_parameters_from_config({"max_position_embeddings": 256,
                                          "original_max_position_embeddings": ORIG,
                                          "rope_parameters": dict(LONGROPE)})
    with pytest.raises(ValueError, match="longrope factors have 6 entries"):
        compute_inv_freq(params, 16, 256)  # a rotary dim of 16 needs 8


def test_choice_follows_max_model_len():
    from tokenmill.models.layers.rotary import longrope_choice
    cfg = {"max_position_embeddings": 256, "original_max_position_embeddings": ORIG,
           "rope_scaling": dict(LONGROPE)}
    assert longrope_choice(cfg, ORIG) is False
    assert longrope_choice(cfg, ORIG + 1) is True
    assert longrope_choice({"rope_scaling": {"rope_type": "yarn"}}, 10 ** 6) is None
    assert longrope_choice({}, 10 ** 6) is None


@pytest.fixture(scope="module")
def phi3_longrope(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("phi3_longrope") / "ckpt")
    hf = build_checkpoint(path, "phi3", dict(
        partial_rotary_factor=0.75, original_max_position_embeddings=ORIG,
        rope_scaling={"rope_theta": 10000.0, **LONGROPE}, tie_word_embeddings=False))
    return TinyModel("phi3_longrope", path, "phi3", hf)


def _greedy(llm, prompts, n):
    # References come one prompt at a time (hf_greedy): in a padded HF batch the
    # longest row's length would pick the factors of every row.
    from tokenmill import SamplingParams
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def test_short_engine_matches_hf_within_the_pretraining_length(phi3_longrope):
    """max_model_len = 64: short factors, as HF uses for every sequence of <= 64 tokens;
    chunked prefill (chunks of 16) across a mixed batch."""
    from tokenmill import LLM
    tm = phi3_longrope
    llm = LLM(tm.path, dtype="float32", device="cpu", max_model_len=ORIG, block_size=8,
              max_num_batched_tokens=16, enable_chunked_prefill=True)
    assert llm.llm_engine.model_config.hf_config["tokenmill_longrope_use_long"] is False
    prompts = make_prompts([5, 40, 17], tm.vocab_size)
    n = 20  # the longest sequence ends at 60 <= 64
    assert _greedy(llm, prompts, n) == [hf_greedy(tm.hf, p, n) for p in prompts]


def test_long_engine_matches_hf_past_the_pretraining_length(phi3_longrope, caplog):
    """max_model_len = 256 (the default): long factors, as HF uses for a prompt already
    longer than 64 tokens; the warning says short prompts differ from HF. The reference
    is HF's dense forward, token by token: transformers 5.24's generate() departs from
    its own dense forward for this model after a few tokens (its cache is not
    recomputed consistently with the switched factors), the dense forward does not."""
    from tokenmill import LLM
    tm = phi3_longrope
    with caplog.at_level("WARNING", logger="tokenmill.config"):
        llm = LLM(tm.path, dtype="float32", device="cpu", block_size=8)
    assert "long rope factors" in caplog.text
    assert llm.llm_engine.model_config.hf_config["tokenmill_longrope_use_long"] is True
    prompts = make_prompts([70, 90], tm.vocab_size, seed=3)
    assert _greedy(llm, prompts, 12) == [_hf_dense_greedy(tm.hf, p, 12) for p in prompts]


def _hf_dense_greedy(model, prompt, n):
    seq = list(prompt)
    for _ in range(n):
        seq.append(hf_next_token(model, seq))
    return seq[len(prompt):]
