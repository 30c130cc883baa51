"""`mtp` speculation on a Qwen3-Next target (README: "mtp" works on Qwen3-Next
checkpoints, not only Qwen3.5): a tiny Qwen3-Next checkpoint (HYBRID_SPECS
"qwen3_next": Gated DeltaNet + gated attention, sparse MoE with a gated shared
expert in every layer) with a random MTP head keeps greedy output token for token
equal to the output without speculation, while drafts are proposed and verified.
A random head's drafts are (nearly) all rejected, so a second test swaps only the
head's token choice for the plain run's tokens (some corrupted on purpose, as
test_spec_oracle.py does for Qwen3.5): drafts are then accepted and rejected
part-way, and the Gated DeltaNet state must go on from the accepted position.
(test_spec_decode.py / test_spec_oracle.py cover the Qwen3.5 target.)"""
from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
import torch

from conftest import make_llm, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.models.mtp import MtpDraftModel
from tokenmill.models.qwen3_next import Qwen3NextForCausalLM, SparseMoeBlock

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models"))

NUM_DRAFT = 3
MAX_TOKENS = 16


@pytest.fixture(autouse=True)
def no_row_budget(monkeypatch):
    """Drafts at every batch size (as in test_spec_decode.py): the CPU's row budget
    would otherwise leave a batch of several requests without drafts."""
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))


@pytest.fixture(scope="module")
def qwen3_next_mtp(tmp_path_factory):
    """A tiny Qwen3-Next checkpoint whose config sets mtp_num_hidden_layers 1, with a
    random MTP head (mtp.* tensors in a shard of their own)."""
    from test_hybrid_parity import HYBRID_SPECS, build_hybrid
    from tokenmill.spec_decode.random_drafters import mtp_tensors, write_folder
    arch, overrides = HYBRID_SPECS["qwen3_next"]
    assert arch == "qwen3_next"
    base = str(tmp_path_factory.mktemp("qwen3_next_base"))
    build_hybrid(base, arch, dict(overrides, mtp_num_hidden_layers=1))
    config = json.load(open(os.path.join(base, "config.json")))
    assert config["model_type"] == "qwen3_next"
    path = str(tmp_path_factory.mktemp("qwen3_next_mtp") / "ckpt")
    write_folder(path, base, config, mtp_tensors(base, seed=7))
    return path, config["vocab_size"]


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(21)
    out = []
    for i in range(4):
        head = rng.integers(0, vocab, size=int(rng.integers(3, 15))).tolist()
        motif = rng.integers(0, vocab, size=3).tolist()
        out.append(head + motif * 3 if i % 2 == 0 else head)
    return out


def _generate(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def test_mtp_on_qwen3_next_keeps_greedy_output(qwen3_next_mtp):
    path, vocab = qwen3_next_mtp
    prompts = _prompts(vocab)
    want = _generate(make_llm(path, max_model_len=96), prompts)
    llm = make_llm(path, max_model_len=96,
                   speculative_config={"method": "mtp", "num_speculative_tokens": NUM_DRAFT})
    runner = runner_of(llm)
    # The MTP drafter runs on the Qwen3-Next target, with its MoE layer and K/V cache.
    assert isinstance(runner.model, Qwen3NextForCausalLM)
    assert isinstance(runner.draft_model, MtpDraftModel)
    assert isinstance(runner.draft_model.layers[0].mlp, SparseMoeBlock)
    assert "draft.0.attn" in runner.kv_caches
    assert scheduler_of(llm).config.num_lookahead_tokens == NUM_DRAFT
    got = _generate(llm, prompts)
    assert got == want
    assert all(len(t) == MAX_TOKENS for t in got)
    stats = scheduler_of(llm).spec_stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens > 0
    assert stats.num_accepted_tokens <= stats.num_draft_tokens
    sched = scheduler_of(llm)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_used_blocks == 0


class _PlainRunDrafts:
    """The real MTP drafter (every forward and K/V write runs), whose token choice is
    the plain run's token, except at positions p % 4 == 1, where another token stands
    (so verification stops part-way). One request at a time: a draft row at position p
    guesses the token at p + 2."""

    shares_target_lm_head = False  # the ids below, not the greedy lm_head's

    def __init__(self, model, seq: list[int], vocab: int):
        self.model, self.seq, self.vocab = model, seq, vocab

    def __getattr__(self, name):  # write_kv, combine_target_hidden, aux_layer_ids, ...
        return getattr(self.__dict__["model"], name)

    def __call__(self, input_ids, positions, hidden, meta):
        out, next_hidden = self.model(input_ids, positions, hidden, meta)
        ids = []
        for p in positions.tolist():
            t = self.seq[p + 2] if p + 2 < len(self.seq) else 0
            ids.append((t + 1) % self.vocab if p % 4 == 1 else t)
        return torch.tensor(ids, device=out.device).view(-1, 1), next_hidden

    def draft_token_ids(self, out):
        return out[:, 0]


def test_mtp_on_qwen3_next_accepted_drafts_keep_greedy_output(qwen3_next_mtp):
    path, vocab = qwen3_next_mtp
    prompts = _prompts(vocab)[:2]
    plain = make_llm(path, max_model_len=96)
    llm = make_llm(path, max_model_len=96,
                   speculative_config={"method": "mtp", "num_speculative_tokens": NUM_DRAFT})
    proposer = runner_of(llm).drafter.model_proposer
    real = proposer.model
    stats = scheduler_of(llm).spec_stats
    for prompt in prompts:
        want = _generate(plain, [prompt])
        proposer.model = _PlainRunDrafts(real, prompt + want[0], vocab)
        assert _generate(llm, [prompt]) == want
    # Drafts passed and failed: the accepted ones moved the recurrent state on.
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_position[1] > 0
    sched = scheduler_of(llm)
    assert not sched.has_unfinished_requests()
    assert sched.kv_cache_manager.num_used_blocks == 0
