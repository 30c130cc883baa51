"""Which targets the hidden-state drafters (EAGLE-3, DFlash) run on, as the README says.

Every registered architecture is either a target whose forward taps the layers a drafter
reads, or refused at start-up by name; on each Llama-family target the README names,
an EAGLE-3 drafter (random weights) leaves the greedy output exactly the target's.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import (MODEL_SPECS, build_checkpoint, make_llm, make_prompts, runner_of,
                      scheduler_of)
from tokenmill import SamplingParams
from tokenmill.models.registry import MODEL_REGISTRY
from tokenmill.spec_decode.loading import HIDDEN_STATE_METHODS, check_hidden_state_target

# What the README lists as refused for eagle3 / dflash (the rest of the registry runs them).
REFUSED = {"Qwen3VLForConditionalGeneration"}


@pytest.mark.parametrize("arch", sorted(MODEL_REGISTRY))
def test_every_architecture_is_a_tapped_target_or_refused(arch):
    cls = MODEL_REGISTRY[arch]
    target = cls.__new__(cls)  # the check reads the class only
    for method in HIDDEN_STATE_METHODS:
        if arch in REFUSED:
            with pytest.raises(ValueError, match=rf"method '{method}' is not supported for "
                                                 rf"{cls.__name__} targets"):
                check_hidden_state_target(method, target)
        else:
            check_hidden_state_target(method, target)
    check_hidden_state_target("ngram", target)
    check_hidden_state_target("mtp", target)


def _greedy(n: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


def _tokens(llm, prompts, n: int = 16) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], _greedy(n), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _target(name: str, tmp_path_factory, tiny_model_factory) -> str:
    return _target_and_hf(name, tmp_path_factory, tiny_model_factory)[0]


_HF: dict[str, tuple[str, object]] = {}


def _target_and_hf(name: str, tmp_path_factory, tiny_model_factory):
    """(checkpoint path, its HF model) of a tiny target: conftest's MODEL_SPECS, the MoE
    or the hybrid suites' specs."""
    if name in MODEL_SPECS:
        tm = tiny_model_factory(name)
        return tm.path, tm.hf
    if name not in _HF:
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))
        from test_hybrid_parity import HYBRID_SPECS, build_hybrid
        from test_moe_parity import MOE_SPECS
        path = str(tmp_path_factory.mktemp(name))
        if name in HYBRID_SPECS:
            hf = build_hybrid(path, *HYBRID_SPECS[name])
        else:
            hf = build_checkpoint(path, *MOE_SPECS[name])
        _HF[name] = (path, hf)
    return _HF[name]


# Every family that taps through the model base (models/layers/taps.py), beside Llama.
TAPPED = ["gemma3", "gemma4_kvshare", "deepseek_v2", "deepseek_v3", "qwen3_5", "qwen3_next",
          "qwen3_headdim"]


@pytest.mark.parametrize("name", TAPPED)
def test_taps_are_hf_hidden_states(name, tmp_path_factory, tiny_model_factory):
    """The taps a drafter reads are HF's `hidden_states` (the stream entering layer i;
    the last: the final normed output), fp32, on one prefill forward."""
    import torch
    path, hf = _target_and_hf(name, tmp_path_factory, tiny_model_factory)
    config = json.load(open(os.path.join(path, "config.json")))
    n = config.get("text_config", config)["num_hidden_layers"]
    prompt = make_prompts([11], config.get("text_config", config)["vocab_size"], seed=3)[0]
    llm = make_llm(path)
    model = runner_of(llm).model
    model.aux_layer_ids = (0, n - 1, 1, n)
    llm.generate([{"prompt_token_ids": prompt}], _greedy(1), use_tqdm=False)  # prefill only
    got = model.aux_hidden
    with torch.no_grad():
        ref = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([ref[i][0] for i in (0, n - 1, 1)] + [ref[n][0]], dim=-1)
    assert got.shape == want.shape
    assert torch.allclose(got, want.float(), atol=1e-4, rtol=1e-4), (got - want).abs().max()


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
@pytest.mark.parametrize("name", ["gemma3", "deepseek_v2", "qwen3_5", "qwen3_next"])
def test_hidden_state_drafters_on_targets_tapped_through_the_base(
        name, method, tmp_path, tmp_path_factory, tiny_model_factory):
    """EAGLE-3 and DFlash (random drafts: most rejected) on Gemma 3's two KV groups,
    DeepSeek's latent cache and the Gated DeltaNet hybrids (whose verify step keeps
    1 + k state slots): greedy output is the target's, with chunked prefill."""
    from tokenmill.spec_decode.random_drafters import (build_dflash_checkpoint,
                                                       build_eagle3_checkpoint)
    path = _target(name, tmp_path_factory, tiny_model_factory)
    config = json.load(open(os.path.join(path, "config.json")))
    text = config.get("text_config", config)
    draft = str(tmp_path / method)
    os.makedirs(draft)
    if method == "eagle3":
        build_eagle3_checkpoint(draft, {**config, **text})
    else:
        build_dflash_checkpoint(draft, {**config, **text}, target_layer_ids=(0, 1),
                                block_size=4)
    prompts = make_prompts([5, 23, 40], text["vocab_size"], seed=31)
    want = _tokens(make_llm(path), prompts)
    llm = make_llm(path, speculative_config={"method": method, "num_speculative_tokens": 3,
                                             "model": draft},
                   max_num_batched_tokens=16, block_size=8)
    assert _tokens(llm, prompts) == want
    assert runner_of(llm).model.aux_hidden is not None  # the taps ran
    assert scheduler_of(llm).spec_stats.num_draft_tokens > 0


@pytest.mark.parametrize("name", ["mistral_swa", "phi3_partial", "qwen2_tied",
                                  "qwen3_moe_norm"])
def test_eagle3_on_each_llama_family_target(name, tmp_path, tmp_path_factory,
                                            tiny_model_factory):
    from tokenmill.spec_decode.random_drafters import build_eagle3_checkpoint
    path = _target(name, tmp_path_factory, tiny_model_factory)
    config = json.load(open(os.path.join(path, "config.json")))
    draft = str(tmp_path / "eagle3")
    os.makedirs(draft)
    build_eagle3_checkpoint(draft, config)
    prompts = make_prompts([5, 23, 40], config["vocab_size"], seed=31)
    want = _tokens(make_llm(path), prompts)
    llm = make_llm(path, speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                             "model": draft},
                   max_num_batched_tokens=16, block_size=8)
    assert _tokens(llm, prompts) == want
    assert runner_of(llm).model.aux_hidden is not None  # the taps ran
    assert scheduler_of(llm).spec_stats.num_draft_tokens > 0


def test_eagle3_on_a_vision_language_target(tmp_path):
    """Qwen2.5-VL (the Llama-family forward with M-RoPE): text and image prompts."""
    from tokenmill.spec_decode.random_drafters import build_eagle3_checkpoint
    from vl_checkpoint import build_vl_checkpoint, make_image
    path = str(tmp_path / "vl")
    build_vl_checkpoint(path)
    config = json.load(open(os.path.join(path, "config.json")))
    text = config.get("text_config", config)
    draft = str(tmp_path / "eagle3")
    os.makedirs(draft)
    build_eagle3_checkpoint(draft, {**config, **text})
    tok = make_llm(path).get_tokenizer()
    prompts = [{"prompt_token_ids": tok.encode("describe the picture of a red car")},
               {"prompt": "<|vision_start|><|image_pad|><|vision_end|>what is it",
                "multi_modal_data": {"image": make_image(32, 40, seed=2)}}]

    def run(llm):
        outs = llm.generate(prompts, _greedy(), use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]
    want = run(make_llm(path))
    llm = make_llm(path, speculative_config={"method": "eagle3", "num_speculative_tokens": 3,
                                             "model": draft})
    assert run(llm) == want


@pytest.mark.parametrize("name", ["gemma3", "deepseek_v2"])
def test_ngram_on_targets_without_taps(name, tiny_model_factory):
    """n-gram drafts need no hidden states: exact on Gemma 3's two KV groups and
    DeepSeek's latent cache too. The prompt holds 100 distinct tokens and the lookup
    takes 1-grams, so a generated token found in the prompt brings drafts (all but
    certain for any weights: each output token has a ~1/4 chance); not adaptive: the
    CPU's row budget may leave no free rows for drafts at fp32."""
    import torch
    tm = tiny_model_factory(name)
    prompt = torch.randperm(tm.vocab_size, generator=torch.Generator().manual_seed(5))
    prompts = [prompt[:100].tolist()]
    want = _tokens(make_llm(tm.path), prompts, 24)
    llm = make_llm(tm.path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 1, "adaptive": False})
    assert _tokens(llm, prompts, 24) == want
    assert scheduler_of(llm).spec_stats.num_draft_tokens > 0


def test_dflash_with_a_reduced_draft_vocabulary(tmp_path, tiny_model_factory):
    """A DFlash head with its own lm_head over 64 draft ids and a d2t map: the engine
    verifies target ids (the drafts mapped), greedy output the target's."""
    import torch
    from safetensors.torch import load_file, save_file

    from tokenmill.spec_decode.random_drafters import build_dflash_checkpoint
    tm = tiny_model_factory("qwen3_headdim")
    config = json.load(open(os.path.join(tm.path, "config.json")))
    draft = str(tmp_path / "dflash")
    os.makedirs(draft)
    build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=4,
                            config_overrides=dict(draft_vocab_size=64))
    file = os.path.join(draft, "model.safetensors")
    t = load_file(file)
    g = torch.Generator().manual_seed(1)
    targets = torch.randperm(config["vocab_size"], generator=g)[:64].sort().values
    t["lm_head.weight"] = 0.2 * torch.randn(64, config["hidden_size"], generator=g)
    t["d2t"] = targets - torch.arange(64)
    save_file(t, file)
    prompts = make_prompts([5, 23, 40], config["vocab_size"], seed=31)
    want = _tokens(make_llm(tm.path), prompts)
    llm = make_llm(tm.path, speculative_config={"method": "dflash", "num_speculative_tokens": 3,
                                                "model": draft},
                   max_num_batched_tokens=16, block_size=8)
    assert _tokens(llm, prompts) == want
    assert scheduler_of(llm).spec_stats.num_draft_tokens > 0


def test_dflash_with_sliding_draft_layers_on_a_hybrid_target(tmp_path, tmp_path_factory,
                                                             tiny_model_factory):
    """The reference's drafter shape: a sliding-window (causal) draft layer beside a
    full one, drafting for a Qwen3.5 target; greedy output the target's."""
    from tokenmill.spec_decode.random_drafters import build_dflash_checkpoint
    path = _target("qwen3_5", tmp_path_factory, tiny_model_factory)
    config = json.load(open(os.path.join(path, "config.json")))
    draft = str(tmp_path / "dflash")
    os.makedirs(draft)
    build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=4,
                            config_overrides=dict(layer_types=["sliding_attention",
                                                               "full_attention"],
                                                  sliding_window=4))
    prompts = make_prompts([5, 23, 40], config["vocab_size"], seed=31)
    want = _tokens(make_llm(path), prompts)
    llm = make_llm(path, speculative_config={"method": "dflash", "num_speculative_tokens": 3,
                                             "model": draft},
                   max_num_batched_tokens=16, block_size=8)
    assert _tokens(llm, prompts) == want
    assert runner_of(llm).drafter.model_proposer.model.config.layer_windows == [4, None]
    assert scheduler_of(llm).spec_stats.num_draft_tokens > 0
