"""`mtp` on DeepSeek-V3 targets: the checkpoint's model.layers.{N} block as the drafter
(tokenmill/models/deepseek_mtp.py).

- Its first forward (one prompt's prefill rows) against a reference made of HF's own
  DeepseekV3DecoderLayer and the block's raw tensors (enorm / hnorm / eh_proj, the
  position-0 mask, shared_head), fp32.
- Greedy output with it equal to the target's alone, with chunked prefill; drafts
  were proposed; refusals by name.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from conftest import make_llm, runner_of, scheduler_of
from test_mtp_qwen3_next import _prompts
from tokenmill import SamplingParams
from tokenmill.spec_decode.random_drafters import deepseek_mtp_tensors, write_folder

MTP = {"method": "mtp", "num_speculative_tokens": 2}


@pytest.fixture(autouse=True)
def no_row_budget(monkeypatch):
    """Drafts at every batch size (as in test_spec_decode.py)."""
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))


@pytest.fixture(scope="module")
def v3_mtp(tiny_model_factory, tmp_path_factory):
    """(folder, HF target, MTP tensors): the tiny V3 target with num_nextn_predict_layers
    1 and a random block in a shard of its own."""
    tm = tiny_model_factory("deepseek_v3")
    config = dict(tm.hf_config, num_nextn_predict_layers=1)
    tensors = deepseek_mtp_tensors(tm.path, seed=11)
    path = str(tmp_path_factory.mktemp("deepseek_v3_mtp") / "ckpt")
    write_folder(path, tm.path, config, tensors)
    return path, tm.hf, tensors


def _generate(llm, prompts, n=12):
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_first_forward_matches_hf_layer_reference(v3_mtp):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer, DeepseekV3RotaryEmbedding)
    path, hf, tensors = v3_mtp
    cfg = hf.config
    n = cfg.num_hidden_layers
    prefix = f"model.layers.{n}."
    block = {k[len(prefix):]: v for k, v in tensors.items()}
    llm = make_llm(path, speculative_config=MTP)
    drafter = runner_of(llm).drafter.model_proposer.model
    calls = []
    real = drafter.forward

    def spy(input_ids, positions, hidden, meta):
        out = real(input_ids, positions, hidden, meta)
        calls.append((input_ids.clone(), positions.clone(), hidden.clone(), out[0].clone(),
                      out[1].clone()))
        return out
    drafter.forward = spy
    prompt = _prompts(cfg.vocab_size)[0]
    _generate(llm, [prompt], 3)
    ids, pos, hidden, out, nxt = calls[0]  # the prefill step: every prompt row
    assert pos.tolist() == list(range(len(prompt)))
    assert ids[:-1].tolist() == prompt[1:]  # token p + 1 beside the hidden state at p

    layer = DeepseekV3DecoderLayer(cfg, layer_idx=n).float().eval()
    own = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")
    state = {k: v for k, v in block.items() if not k.startswith(own)}
    # HF's module stacks the experts its checkpoints store one by one: [E, 2I, H], [E, H, I].
    experts = sorted({int(k.split(".")[2]) for k in state if k.startswith("mlp.experts.")})
    if experts:
        def one(e, name):
            return state.pop(f"mlp.experts.{e}.{name}.weight")
        state["mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([one(e, "gate_proj"), one(e, "up_proj")]) for e in experts])
        state["mlp.experts.down_proj"] = torch.stack([one(e, "down_proj") for e in experts])
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    rotary = DeepseekV3RotaryEmbedding(cfg)
    with torch.no_grad():
        e = hf.model.embed_tokens(ids)  # the target's embedding (the block's copy unused)
        e[pos == 0] = 0.0
        eps = cfg.rms_norm_eps
        x = torch.cat([_rms(e, block["enorm.weight"], eps),
                       _rms(hidden, block["hnorm.weight"], eps)], -1) @ block["eh_proj.weight"].T
        x = x[None]
        t = x.shape[1]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        cos_sin = rotary(x, pos[None])
        got = layer(x, attention_mask=mask, position_ids=pos[None], position_embeddings=cos_sin)
        x_ref = (got[0] if isinstance(got, tuple) else got)[0]
        out_ref = _rms(x_ref, block["shared_head.norm.weight"], eps)
    torch.testing.assert_close(nxt, x_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out, out_ref, atol=1e-4, rtol=1e-4)
    # Drafts: argmax of the block's own head.
    want = F.linear(out_ref, block["shared_head.head.weight"]).argmax(-1)
    assert torch.equal(drafter.draft_token_ids(out), want)


def test_mtp_keeps_greedy_output(v3_mtp):
    path, hf, _ = v3_mtp
    prompts = _prompts(hf.config.vocab_size)
    want = _generate(make_llm(path), prompts)
    for extra in ({}, {"max_num_batched_tokens": 16, "block_size": 8}):
        llm = make_llm(path, speculative_config=MTP, **extra)
        assert _generate(llm, prompts) == want
        assert scheduler_of(llm).spec_stats.num_draft_tokens > 0


def test_refusals_name_what_is_missing(v3_mtp, tmp_path, tiny_model_factory):
    _, _, tensors = v3_mtp
    tm = tiny_model_factory("deepseek_v3")
    # No MTP layers in the config.
    none = str(tmp_path / "none")
    write_folder(none, tm.path, dict(tm.hf_config, num_nextn_predict_layers=0), None)
    with pytest.raises(ValueError, match="no MTP layers.*num_nextn_predict_layers"):
        make_llm(none, speculative_config=MTP)
    # The config says 1 (HF's default for V3), the weights are absent.
    with pytest.raises(ValueError, match=r"no MTP weights \(no model.layers.\d+.\* tensors\)"):
        make_llm(tm.path, speculative_config=dict(MTP))
    # A tensor missing from the block is named.
    partial = str(tmp_path / "partial")
    n = tm.hf_config["num_hidden_layers"]
    write_folder(partial, tm.path, dict(tm.hf_config, num_nextn_predict_layers=1),
                 {k: v for k, v in tensors.items() if k != f"model.layers.{n}.enorm.weight"})
    with pytest.raises(ValueError, match="enorm.weight"):
        make_llm(partial, speculative_config=MTP)
    # Two MTP layers: not this drafter's.
    two = str(tmp_path / "two")
    write_folder(two, tm.path, dict(tm.hf_config, num_nextn_predict_layers=2), tensors)
    with pytest.raises(ValueError, match="num_nextn_predict_layers must be 1"):
        make_llm(two, speculative_config=MTP)
