"""The model runner on a hybrid model (Gated DeltaNet + full attention), driven directly.

The reference runner's invariants (test_runner.cpp.txt), in Python against our
ModelRunner with hand-built SchedulerOutputs and a tiny Qwen3.5 checkpoint:

* KV allocation from a KVCacheConfig with a full-attention group and a
  MambaSpec group: one paged KV tensor per attention layer, one (conv, SSM)
  state pair per DeltaNet layer, conv [slots, conv_dim, K-1] and SSM
  [slots, Hv, Dv, Dk]; a spec with bf16 conv / fp16 SSM state is honoured
  (the MambaSpec, not the model, is the source of truth).
* A third (draft) full-attention group does not move the target's group.
* State slots are keyed on the request id: unique when every block table's
  column 0 is the null block, unique across finish/admit churn (a continuing
  request keeps its slot, a finished one's is reused), released on preemption
  and zeroed again when the request comes back.
* A full-attention-only model allocates no state and builds no state metadata.
* A prompt split into chunks [3, 1, 2, rest] leaves the same conv and SSM
  state as the whole prompt in one step (and as HF's cache).
* The GDN math (conv1d, chunked and recurrent delta rule) against transformers'
  torch reference functions, with lengths that are not multiples of 64, split
  points and Hv > Hk.
"""
from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import TinyModel, build_checkpoint, hf_greedy, hf_next_token
from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup, MambaSpec
from tokenmill.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from tokenmill.models.layers.gated_deltanet import (conv1d_decode, conv1d_prefill,
                                                    delta_rule_chunked, delta_rule_decode,
                                                    l2_normalize)
from tokenmill.models.loader import load_model
from tokenmill.sampling_params import SamplingParams
from tokenmill.worker.kv_cache import TORCH_DTYPES
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.platforms import create_platform

BS = 4
MAX_LEN = 96
CPU = torch.device("cpu")

# Tiny Qwen3.5: 3 linear-attention layers then 1 full-attention layer; Hk 2 < Hv 4.
HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def hy(tmp_path_factory) -> TinyModel:
    path = str(tmp_path_factory.mktemp("qwen3_5_runner"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        hf = build_checkpoint(path, "qwen3_5", HYBRID, seed=11)
        with torch.no_grad():  # A_log / dt_bias away from their defaults
            for name, p in hf.named_parameters():
                if name.endswith(("A_log", "dt_bias")):
                    p.normal_(0.0, 0.2)
        hf.save_pretrained(path)
    return TinyModel("qwen3_5_runner", path, "qwen3_5", hf)


@pytest.fixture(scope="module")
def dense(tiny_model_factory) -> TinyModel:
    return tiny_model_factory("qwen3_headdim")  # full attention only


def gdn_dims(hy):
    c = hy.hf_config
    key_dim = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    conv_dim = 2 * key_dim + c["linear_num_value_heads"] * c["linear_value_head_dim"]
    return dict(conv=(c["linear_conv_kernel_dim"] - 1, conv_dim),
                ssm=(c["linear_num_value_heads"], c["linear_value_head_dim"],
                     c["linear_key_head_dim"]))


def make_kv_config(hy, num_blocks=24, num_slots=8, conv_dtype="float32", ssm_dtype="float32",
                   extra_groups=()):
    """Group 0: the attention layer; group 1: the 3 DeltaNet layers (from the HF config)."""
    c = hy.hf_config
    d = gdn_dims(hy)
    attn = FullAttentionSpec(BS, c["num_key_value_heads"], c["head_dim"], "float32")
    state = MambaSpec((d["conv"], d["ssm"]), (conv_dtype, ssm_dtype))
    groups = [KVCacheGroup(["layers.0.attn"], attn),
              KVCacheGroup([f"layers.{i}.state" for i in range(3)], state), *extra_groups]
    return KVCacheConfig(num_blocks, groups, num_state_slots=num_slots)


def make_runner(tm, config, max_num_reqs=8):
    platform = create_platform(CPU, torch.float32)
    model = load_model(tm.path, tm.hf_config, torch.float32, CPU, platform)
    runner = ModelRunner(model, dtype=torch.float32, device=CPU, max_num_reqs=max_num_reqs,
                         max_model_len=MAX_LEN, max_num_batched_tokens=128, platform=platform)
    runner.initialize_kv_cache(config)
    return runner


def greedy():
    return SamplingParams(temperature=0.0, max_tokens=64)


def new_req(rid, prompt, fa_blocks, num_computed=0, output=(), groups=2):
    block_ids = [list(fa_blocks)] + [[] for _ in range(groups - 1)]
    return NewRequestData(req_id=rid, prompt_token_ids=list(prompt), sampling_params=greedy(),
                          block_ids=block_ids, num_computed_tokens=num_computed,
                          output_token_ids=list(output))


def cached(*entries, groups=2):
    """entries: (req_id, num_computed_tokens, new fa blocks or None, resumed=False)."""
    c = CachedRequestData()
    for e in entries:
        rid, computed, blocks = e[:3]
        c.req_ids.append(rid)
        c.num_computed_tokens.append(computed)
        c.new_block_ids.append(None if blocks is None
                               else [list(blocks)] + [[] for _ in range(groups - 1)])
        c.resumed_from_preemption.append(e[3] if len(e) > 3 else False)
    return c


def step(runner, sched, new=(), cached_reqs=None, finished=(), preempted=()):
    so = SchedulerOutput(list(new), cached_reqs or CachedRequestData(), dict(sched),
                         sum(sched.values()), set(finished), set(preempted))
    runner.execute_model(so)
    return runner.sample_tokens()


def token_of(out, rid):
    toks = out.sampled_token_ids[out.req_id_to_index[rid]]
    assert len(toks) == 1, f"{rid} sampled {toks}"
    return toks[0]


def prompt_of(n, start):
    return [(start + 37 * i) % 384 for i in range(n)]


def state_indices(runner) -> list[int]:
    meta = runner.last_attn_meta.state
    assert meta is not None
    return meta.state_indices.tolist()


def slot_of(runner, rid) -> int:
    return state_indices(runner)[runner.input_batch.req_id_to_index[rid]]


def assert_unique(runner, n):
    idx = state_indices(runner)
    assert len(idx) == n
    assert len(set(idx)) == n, f"duplicate live state slots {idx}"
    assert all(0 <= s < runner.state_slots.num_slots for s in idx)
    # The slots are keyed on the request ids of the batch.
    batch = runner.input_batch
    assert {batch.req_ids[r]: s for r, s in enumerate(idx)} == \
        {rid: runner.state_slots.slot_of[rid] for rid in batch.req_ids[:n]}
    return idx


def slot_state(runner, slot) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(conv[slot].clone(), ssm[slot].clone()) for conv, ssm in runner.state_caches.values()]


# ---- KV allocation from the KVCacheConfig ----------------------------------------------

def test_kv_allocation_full_attention_and_gdn_state(hy):
    config = make_kv_config(hy, num_blocks=10, num_slots=5)
    runner = make_runner(hy, config)
    c, d = hy.hf_config, gdn_dims(hy)
    assert runner.attn_group_id == 0 and runner.state_group_id == 1
    # The runner's own specs agree with the HF-config arithmetic above.
    specs = runner.get_kv_cache_spec(BS)
    assert set(specs) == {"layers.0.attn", "layers.0.state", "layers.1.state", "layers.2.state"}
    assert specs["layers.0.attn"] == config.groups[0].spec
    for i in range(3):
        assert specs[f"layers.{i}.state"] == config.groups[1].spec
    # One paged KV tensor for the one attention layer.
    assert list(runner.kv_caches) == ["layers.0.attn"]
    kv = runner.kv_caches["layers.0.attn"]
    assert kv.shape == (10, 2, BS, c["num_key_value_heads"], c["head_dim"])
    assert runner.attention_layers()["layers.0.attn"].kv_cache is kv
    # One (conv, SSM) pair per DeltaNet layer, num_state_slots rows (not num_blocks).
    assert sorted(runner.state_caches) == ["layers.0.state", "layers.1.state", "layers.2.state"]
    layers = runner.state_layers()
    ptrs = set()
    for name, (conv, ssm) in runner.state_caches.items():
        assert conv.shape == (5, *d["conv"]) == (5, 3, 96)
        assert ssm.shape == (5, *d["ssm"]) == (5, 4, 8, 16)
        assert conv.dtype == ssm.dtype == torch.float32
        assert layers[name].state[0] is conv and layers[name].state[1] is ssm
        ptrs.update({conv.untyped_storage().data_ptr(), ssm.untyped_storage().data_ptr()})
    assert len(ptrs) == 6  # no two layers share state memory
    assert runner.state_slots.num_slots == 5 and runner.state_slots.num_free == 5
    assert config.state_bytes() == 3 * 5 * config.groups[1].spec.page_size_bytes


@pytest.mark.parametrize("mark_draft", [True, False], ids=["draft_marked", "draft_unmarked"])
def test_third_draft_attention_group_does_not_move_the_target_group(hy, mark_draft):
    c = hy.hf_config
    draft = KVCacheGroup(["draft.layers.0.attn"],
                         FullAttentionSpec(BS, c["num_key_value_heads"], c["head_dim"], "float32"),
                         is_draft=mark_draft)
    config = make_kv_config(hy, extra_groups=[draft])
    assert len(config.groups) == 3
    assert config.attention_group_id == 0 and config.state_group_id == 1
    runner = make_runner(hy, config)
    assert runner.attn_group_id == 0 and runner.state_group_id == 1
    # The target's attention layer reads and writes group 0's cache and block table.
    assert runner.attention_layers()["layers.0.attn"].kv_cache is runner.kv_caches["layers.0.attn"]
    prompt = prompt_of(7, 3)
    so_new = new_req("A", prompt, [3, 4], groups=3)
    so_new.block_ids[2] = [7, 8]  # the draft's own blocks
    out = step(runner, {"A": 7}, new=[so_new])
    assert token_of(out, "A") == hf_next_token(hy.hf, prompt)
    assert runner.last_step.block_table[0, :2].tolist() == [3, 4]
    assert set(runner.last_step.slot_mapping // BS) == {3, 4}


def test_mamba_spec_is_the_allocation_source_of_truth(hy):
    config = make_kv_config(hy, num_slots=6, conv_dtype="bfloat16", ssm_dtype="float16")
    spec = config.groups[1].spec
    runner = make_runner(hy, config)
    assert len(runner.state_caches) == 3
    for conv, ssm in runner.state_caches.values():
        assert conv.dtype == TORCH_DTYPES[spec.dtypes[0]] == torch.bfloat16
        assert ssm.dtype == TORCH_DTYPES[spec.dtypes[1]] == torch.float16
        assert tuple(conv.shape[1:]) == spec.shapes[0]
        assert tuple(ssm.shape[1:]) == spec.shapes[1]
        assert conv.shape[0] == ssm.shape[0] == 6
        row_bytes = (conv[0].numel() * conv.element_size() + ssm[0].numel() * ssm.element_size())
        assert row_bytes == spec.page_size_bytes
    # The narrower state still computes: a prompt and a few decodes, the state stays in
    # the spec's dtypes and the slot holds something.
    prompt = prompt_of(9, 1)
    out = step(runner, {"A": 9}, new=[new_req("A", prompt, [1, 2, 3])])
    tok = token_of(out, "A")
    for k in range(3):
        out = step(runner, {"A": 1}, cached_reqs=cached(("A", 9 + k, None)))
        tok = token_of(out, "A")
        assert 0 <= tok < 384
    slot = runner.state_slots.slot_of["A"]
    for conv, ssm in runner.state_caches.values():
        assert conv.dtype == torch.bfloat16 and ssm.dtype == torch.float16
        assert conv[slot].abs().sum() > 0 and ssm[slot].abs().sum() > 0
        assert torch.isfinite(ssm[slot].float()).all()


# ---- state slots ---------------------------------------------------------------------------

def test_state_slots_unique_when_column_0_is_the_null_block(hy):
    runner = make_runner(hy, make_kv_config(hy))
    # Two decodes whose attention block tables start with the null block 0 (as after
    # skipped front blocks); the state group presents block 0 too.
    a = new_req("A", [5, 9, 2], [0, 1], num_computed=3, output=[7])
    b = new_req("B", [1, 4, 8], [0, 2], num_computed=3, output=[6])
    a.block_ids[1] = b.block_ids[1] = [0]
    out = step(runner, {"A": 1, "B": 1}, new=[a, b])
    assert len(out.sampled_token_ids) == 2
    assert runner.last_step.block_table[:2, 0].tolist() == [0, 0]
    idx = assert_unique(runner, 2)
    assert runner.last_attn_meta.state.num_decodes == 2
    assert sorted(runner.state_slots.slot_of) == ["A", "B"]
    assert runner.state_slots.num_free == 8 - 2
    assert idx[0] != idx[1]


def test_state_slots_unique_across_finish_and_admit_churn(hy):
    # Two slots only: an admitted request can only get the slot a finished one gave back.
    runner = make_runner(hy, make_kv_config(hy, num_slots=2))
    a = new_req("A", [5, 9, 2], [0, 1], num_computed=3, output=[7])
    b = new_req("B", [1, 4, 8], [0, 2], num_computed=3, output=[6])
    step(runner, {"A": 1, "B": 1}, new=[a, b])
    assert_unique(runner, 2)
    a_slot, b_slot = slot_of(runner, "A"), slot_of(runner, "B")
    # A finishes; C is admitted (its block table also starts with 0, reusing A's block 1);
    # B continues.
    c = new_req("C", [3, 3, 3], [0, 1], num_computed=3, output=[9])
    step(runner, {"B": 1, "C": 1}, new=[c], cached_reqs=cached(("B", 4, None)), finished={"A"})
    assert_unique(runner, 2)
    assert slot_of(runner, "B") == b_slot
    assert slot_of(runner, "C") == a_slot != b_slot
    assert "A" not in runner.state_slots.slot_of
    # B finishes, D is admitted, C continues: D takes B's slot, C keeps its own.
    d = new_req("D", [8, 8], [0, 3], num_computed=2, output=[1])
    step(runner, {"C": 1, "D": 1}, new=[d], cached_reqs=cached(("C", 4, None)), finished={"B"})
    assert_unique(runner, 2)
    assert slot_of(runner, "C") == a_slot and slot_of(runner, "D") == b_slot


class HybridSim:
    """Plays the scheduler for a hybrid runner; every sampled token is checked against a
    dense HF forward over the request's tokens."""

    def __init__(self, runner, hf, num_blocks):
        self.runner, self.hf = runner, hf
        self.free = list(range(1, num_blocks))
        self.reqs: dict[str, dict] = {}
        self.finished_pending: set[str] = set()
        self.num_checked = 0
        self.slots_seen: dict[str, set[int]] = {}

    def add(self, rid, prompt):
        self.reqs[rid] = dict(tokens=list(prompt), n_prompt=len(prompt), computed=0, blocks=[],
                              known=False, resumed=False)

    def preempt(self, rid):
        r = self.reqs[rid]
        self.free.extend(r["blocks"])
        r.update(computed=0, blocks=[], resumed=True)

    def finish(self, rid):
        self.free.extend(self.reqs.pop(rid)["blocks"])
        self.finished_pending.add(rid)

    def step(self, sched: dict[str, int], preempted=()):
        new, entries, expect = [], [], {}
        for rid, n in sched.items():
            r = self.reqs[rid]
            need = -(-(r["computed"] + n) // BS) - len(r["blocks"])
            extra = [self.free.pop(0) for _ in range(max(0, need))]
            r["blocks"] += extra
            if not r["known"]:
                new.append(new_req(rid, r["tokens"][:r["n_prompt"]], r["blocks"],
                                   num_computed=r["computed"], output=r["tokens"][r["n_prompt"]:]))
                r["known"] = True
            elif r["resumed"]:
                entries.append((rid, r["computed"], list(r["blocks"]), True))
            else:
                entries.append((rid, r["computed"], extra or None))
            r["resumed"] = False
            done = r["computed"] + n == len(r["tokens"])
            expect[rid] = [hf_next_token(self.hf, r["tokens"])] if done else []
        so = SchedulerOutput(new, cached(*entries), dict(sched), sum(sched.values()),
                             set(self.finished_pending), set(preempted))
        self.finished_pending = set()
        self.runner.execute_model(so)
        out = self.runner.sample_tokens()
        if sched:
            assert_unique(self.runner, len(sched))
        for rid, n in sched.items():
            r = self.reqs[rid]
            got = out.sampled_token_ids[out.req_id_to_index[rid]]
            assert got == expect[rid], f"{rid} at {r['computed']}+{n}/{len(r['tokens'])}"
            self.num_checked += len(got)
            r["computed"] += n
            r["tokens"] += got
            self.slots_seen.setdefault(rid, set()).add(self.runner.state_slots.slot_of[rid])
        return out


@pytest.mark.parametrize("seed", [0, 1])
def test_random_churn_keeps_states_apart(hy, seed):
    """Arrivals, prompt chunks, skipped steps, finishes and preemptions with as many slots
    as live requests: slots are reused all the time, tokens still match HF."""
    rng = random.Random(seed)
    max_live = 3
    runner = make_runner(hy, make_kv_config(hy, num_blocks=64, num_slots=max_live))
    sim = HybridSim(runner, hy.hf, 64)
    next_id, num_preempted = 0, 0
    for step_no in range(22):
        if len(sim.reqs) < max_live and rng.random() < 0.6:
            sim.add(f"r{next_id}", prompt_of(rng.randint(1, 14), rng.randint(0, 383)))
            next_id += 1
        for rid in list(sim.reqs):
            r = sim.reqs[rid]
            if len(r["tokens"]) - r["n_prompt"] >= rng.randint(2, 5) and rng.random() < 0.5:
                sim.finish(rid)
        preempted = set()
        victims = [rid for rid, r in sim.reqs.items() if r["known"] and r["computed"]]
        if victims and step_no in (6, 13, 19):
            victim = rng.choice(victims)
            sim.preempt(victim)
            preempted.add(victim)
            num_preempted += 1
        sched = {}
        for rid, r in sim.reqs.items():
            if rid in preempted or rng.random() < 0.15:
                continue
            rem = len(r["tokens"]) - r["computed"]
            sched[rid] = rng.randint(1, rem)
        sim.step(sched, preempted)
        for rid in preempted:
            assert rid not in runner.state_slots.slot_of
    assert sim.num_checked >= 12 and next_id >= 5 and num_preempted >= 2
    # Slots were shared over time by different requests (reuse really happened).
    owners = {}
    for rid, slots in sim.slots_seen.items():
        for s in slots:
            owners.setdefault(s, set()).add(rid)
    assert max(len(v) for v in owners.values()) >= 2


def test_preempted_request_releases_its_slot_and_restarts_from_zero(hy):
    runner = make_runner(hy, make_kv_config(hy, num_slots=2))
    pa, pb = prompt_of(10, 2), prompt_of(6, 50)
    tokens_b = list(pb)

    def check_b(out):
        tokens_b.append(token_of(out, "B"))
        assert tokens_b[-1] == hf_next_token(hy.hf, tokens_b[:-1])

    out = step(runner, {"A": 10, "B": 6}, new=[new_req("A", pa, [1, 2, 3]),
                                               new_req("B", pb, [4, 5])])
    toks_a = [token_of(out, "A")]
    check_b(out)
    out = step(runner, {"A": 1, "B": 1}, cached_reqs=cached(("A", 10, None), ("B", 6, None)))
    toks_a.append(token_of(out, "A"))
    check_b(out)
    a_slot = runner.state_slots.slot_of["A"]
    # A is preempted (not scheduled); B decodes.
    out = step(runner, {"B": 1}, cached_reqs=cached(("B", 7, None)), preempted={"A"})
    assert "A" not in runner.state_slots.slot_of and runner.state_slots.num_free == 1
    assert slot_of(runner, "B") != a_slot
    check_b(out)
    # Stale garbage in the freed slot (as another request would leave there).
    for conv, ssm in runner.state_caches.values():
        conv[a_slot] = 3.0
        ssm[a_slot] = -2.0
    # A comes back from the start: prompt + its 2 outputs in one chunk, fresh blocks.
    tokens_a = pa + toks_a
    out = step(runner, {"A": 12, "B": 1},
               cached_reqs=cached(("A", 0, [6, 7, 8], True), ("B", 8, None)))
    assert token_of(out, "A") == hf_next_token(hy.hf, tokens_a)
    check_b(out)
    assert_unique(runner, 2)
    # Its state equals a fresh runner's after the same tokens in one step.
    fresh = make_runner(hy, make_kv_config(hy, num_slots=2))
    step(fresh, {"A": 12}, new=[new_req("A", pa, [1, 2, 3], output=toks_a)])
    got = slot_state(runner, runner.state_slots.slot_of["A"])
    want = slot_state(fresh, fresh.state_slots.slot_of["A"])
    for (c1, s1), (c2, s2) in zip(got, want):
        torch.testing.assert_close(c1, c2, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s1, s2, rtol=1e-4, atol=1e-5)


# ---- full-attention-only model -------------------------------------------------------------

def test_full_attention_only_model_has_no_state(dense):
    platform = create_platform(CPU, torch.float32)
    model = load_model(dense.path, dense.hf_config, torch.float32, CPU, platform)
    runner = ModelRunner(model, dtype=torch.float32, device=CPU, max_num_reqs=8,
                         max_model_len=MAX_LEN, max_num_batched_tokens=64, platform=platform)
    assert runner.state_layers() == {}
    specs = runner.get_kv_cache_spec(BS)
    assert all(isinstance(s, FullAttentionSpec) for s in specs.values())
    spec = next(iter(specs.values()))
    config = KVCacheConfig(12, [KVCacheGroup(list(specs), spec)])
    assert config.state_group_id is None and config.num_state_slots == 0
    assert config.state_bytes() == 0
    runner.initialize_kv_cache(config)
    assert runner.attn_group_id == 0 and runner.state_group_id is None
    assert runner.state_caches == {} and runner.state_slots is None
    assert len(runner.kv_caches) == dense.hf_config["num_hidden_layers"]
    for cache in runner.kv_caches.values():
        assert cache.shape == (12, 2, BS, spec.num_kv_heads, spec.head_size)
    # Steps run without the state path: no state metadata, tokens still right.
    prompt = prompt_of(5, 9)
    nr = NewRequestData("A", prompt, greedy(), [[1, 2]], 0)
    so = SchedulerOutput([nr], CachedRequestData(), {"A": 5}, 5)
    runner.execute_model(so)
    assert runner.last_attn_meta.state is None
    tok = token_of(runner.sample_tokens(), "A")
    assert tok == hf_next_token(dense.hf, prompt)
    c = CachedRequestData(["A"], [False], [None], [5])
    runner.execute_model(SchedulerOutput([], c, {"A": 1}, 1))
    assert runner.last_attn_meta.state is None
    assert token_of(runner.sample_tokens(), "A") == hf_next_token(dense.hf, prompt + [tok])


# ---- chunked prompt state == whole prompt state ------------------------------------------

def _hf_states(hf, tokens):
    """HF's (conv, SSM) state per DeltaNet layer after a forward over `tokens`, in our layout."""
    with torch.inference_mode():
        out = hf(torch.tensor([tokens]), use_cache=True)
    cache = out.past_key_values
    states = []
    for i, t in enumerate(hf.config.layer_types):
        if t == "linear_attention":
            conv = cache.get_conv_state(i, state_idx=0)[0]  # [conv_dim, K]: the last K inputs
            ssm = cache.get_recurrent_state(i, state_idx=0)[0]  # [Hv, Dk, Dv]
            states.append((conv[:, 1:].t(), ssm.transpose(-1, -2)))
    return states


@pytest.mark.parametrize("chunks", [[3, 1, 2], [1, 1, 1, 1, 2], [64], [65, 1]],
                         ids=["3-1-2-rest", "1-1-1-1-2-rest", "64-rest", "65-1-rest"])
def test_chunked_prompt_state_equals_whole_prompt_state(hy, chunks):
    prompt = prompt_of(70, 7)
    whole = make_runner(hy, make_kv_config(hy, num_blocks=40))
    out = step(whole, {"A": 70}, new=[new_req("A", prompt, range(1, 19))])
    tok_whole = token_of(out, "A")
    assert tok_whole == hf_next_token(hy.hf, prompt)

    split = make_runner(hy, make_kv_config(hy, num_blocks=40))
    # Another request holds slot 0 first, so the two runners use different slots.
    step(split, {"X": 2}, new=[new_req("X", [1, 2], [30])])
    sizes = chunks + [70 - sum(chunks)]
    done = 0
    for k, n in enumerate(sizes):
        if k == 0:
            out = step(split, {"A": n}, new=[new_req("A", prompt, range(1, 19))])
        else:
            out = step(split, {"A": n}, cached_reqs=cached(("A", done, None)))
        done += n
        toks = out.sampled_token_ids[out.req_id_to_index["A"]]
        assert toks == ([] if done < 70 else [tok_whole])
        # After every chunk, the state is HF's after a forward over the prefix so far.
        slot = split.state_slots.slot_of["A"]
        for (c, s), (ch, sh) in zip(slot_state(split, slot), _hf_states(hy.hf, prompt[:done])):
            torch.testing.assert_close(c, ch, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(s, sh, rtol=1e-3, atol=1e-4)
    s_whole, s_split = whole.state_slots.slot_of["A"], split.state_slots.slot_of["A"]
    assert s_whole != s_split
    hf_states = _hf_states(hy.hf, prompt)
    for (cw, sw), (cs, ss), (ch, sh) in zip(slot_state(whole, s_whole),
                                            slot_state(split, s_split), hf_states):
        torch.testing.assert_close(cs, cw, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(ss, sw, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(cw, ch, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(sw, sh, rtol=1e-3, atol=1e-4)


# ---- GDN math against transformers' torch references ---------------------------------------

def _hf_fns():
    from transformers.models.qwen3_5.modeling_qwen3_5 import (torch_chunk_gated_delta_rule,
                                                              torch_recurrent_gated_delta_rule)
    return torch_chunk_gated_delta_rule, torch_recurrent_gated_delta_rule


def _inputs(length, hk, hv, dk=16, dv=8, batch=None, seed=0):
    """q/k L2-normalised [.., L, Hk, Dk], v [.., L, Hv, Dv], g <= 0 and beta in (0, 1)."""
    g_ = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    q = l2_normalize(torch.randn(*lead, length, hk, dk, generator=g_))
    k = l2_normalize(torch.randn(*lead, length, hk, dk, generator=g_))
    v = torch.randn(*lead, length, hv, dv, generator=g_)
    g = -F.softplus(torch.randn(*lead, length, hv, generator=g_)) * 0.5
    beta = torch.sigmoid(torch.randn(*lead, length, hv, generator=g_))
    state = 0.3 * torch.randn(*lead, hv, dv, dk, generator=g_)  # our layout [Hv, Dv, Dk]
    return q, k, v, g, beta, state


def _ours(q, k, hv, dk):
    """Our functions take q/k expanded to the value heads, q already scaled."""
    rep = hv // q.shape[-2]
    return (q * dk ** -0.5).repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


@pytest.mark.parametrize("heads", [(2, 4), (4, 4)], ids=["hk2_hv4", "hk4_hv4"])
@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 130])
def test_delta_rule_chunked_matches_hf(heads, length):
    chunk_fn, _ = _hf_fns()
    hk, hv = heads
    q, k, v, g, beta, state = _inputs(length, hk, hv, seed=length)
    want, want_state = chunk_fn(q[None], k[None], v[None], g[None], beta[None],
                                initial_state=state.transpose(-1, -2)[None],
                                output_final_state=True)
    qo, ko = _ours(q, k, hv, 16)
    for chunk in (64, 16):
        got, got_state = delta_rule_chunked(qo, ko, v, g, beta, state, chunk=chunk)
        torch.testing.assert_close(got, want[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_state, want_state[0].transpose(-1, -2), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("split", [1, 3, 63, 64, 65, 100])
def test_delta_rule_split_prompt_carries_state(split):
    chunk_fn, _ = _hf_fns()
    q, k, v, g, beta, _ = _inputs(130, 2, 4, seed=split)
    want, want_state = chunk_fn(q[None], k[None], v[None], g[None], beta[None],
                                output_final_state=True)
    qo, ko = _ours(q, k, 4, 16)
    s = torch.zeros(4, 8, 16)
    out1, s = delta_rule_chunked(qo[:split], ko[:split], v[:split], g[:split], beta[:split], s)
    out2, s = delta_rule_chunked(qo[split:], ko[split:], v[split:], g[split:], beta[split:], s)
    torch.testing.assert_close(torch.cat([out1, out2]), want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s, want_state[0].transpose(-1, -2), rtol=1e-4, atol=1e-5)


def test_delta_rule_decode_matches_hf_recurrent():
    _, rec_fn = _hf_fns()
    steps, rows = 6, 3
    q, k, v, g, beta, state = _inputs(steps, 2, 4, batch=rows, seed=3)
    want, want_state = rec_fn(q, k, v, g, beta, initial_state=state.transpose(-1, -2),
                              output_final_state=True)
    qo, ko = _ours(q, k, 4, 16)
    ssm = torch.randn(6, 4, 8, 16)
    slots = torch.tensor([4, 0, 2])
    ssm[slots] = state
    untouched = ssm[[1, 3, 5]].clone()
    for t in range(steps):
        out = delta_rule_decode(qo[:, t], ko[:, t], v[:, t], g[:, t], beta[:, t], ssm, slots)
        torch.testing.assert_close(out, want[:, t], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ssm[slots], want_state.transpose(-1, -2), rtol=1e-4, atol=1e-5)
    assert torch.equal(ssm[[1, 3, 5]], untouched)


def test_prompt_chunk_then_decodes_match_hf_recurrent():
    """Chunked prefill of 37 tokens, then 5 decode steps == HF's recurrent form over all 42."""
    _, rec_fn = _hf_fns()
    q, k, v, g, beta, _ = _inputs(42, 2, 4, seed=9)
    want, _ = rec_fn(q[None], k[None], v[None], g[None], beta[None])
    qo, ko = _ours(q, k, 4, 16)
    out, s = delta_rule_chunked(qo[:37], ko[:37], v[:37], g[:37], beta[:37], torch.zeros(4, 8, 16))
    ssm = torch.zeros(2, 4, 8, 16)
    ssm[1] = s
    outs = [out]
    slot = torch.tensor([1])
    for t in range(37, 42):
        outs.append(delta_rule_decode(qo[t:t + 1], ko[t:t + 1], v[t:t + 1], g[t:t + 1],
                                      beta[t:t + 1], ssm, slot))
    torch.testing.assert_close(torch.cat(outs), want[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("pieces", [[1, 2, 3, 4, 10], [2, 1, 1, 16], [20]])
def test_conv1d_split_prefill_and_decode_match_whole_causal_conv(pieces):
    """The carried conv state makes pieces (also shorter than the kernel) and decode steps
    convolve exactly like one causal conv over the whole sequence."""
    torch.manual_seed(0)
    channels, kernel, length = 12, 4, 24
    x = torch.randn(length, channels)
    w = torch.randn(channels, kernel)
    want = F.silu(F.conv1d(F.pad(x.t(), (kernel - 1, 0)).unsqueeze(0), w.unsqueeze(1),
                           groups=channels)[0].t())
    conv_state = torch.zeros(3, kernel - 1, channels)
    conv_state[0] = 5.0  # another sequence's state: untouched
    outs, pos = [], 0
    for n in pieces:
        outs.append(conv1d_prefill(x[pos:pos + n], conv_state, 2, w, None))
        pos += n
    while pos < length:
        outs.append(conv1d_decode(x[pos:pos + 1], conv_state, torch.tensor([2]), w, None))
        pos += 1
    torch.testing.assert_close(torch.cat(outs), want, rtol=1e-5, atol=1e-6)
    assert torch.equal(conv_state[2], x[-(kernel - 1):])
    assert torch.all(conv_state[0] == 5.0) and torch.all(conv_state[1] == 0)


def test_engine_hybrid_greedy_matches_hf(hy):
    """Through the engine, a quick end-to-end check on this file's checkpoint."""
    from conftest import make_llm
    prompt = prompt_of(11, 4)
    llm = make_llm(hy.path, max_model_len=MAX_LEN, max_num_batched_tokens=4, block_size=4)
    out = llm.generate([{"prompt_token_ids": prompt}],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
                       use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hy.hf, prompt, 8)
    assert np.all(np.array(out.outputs[0].token_ids) < 384)
