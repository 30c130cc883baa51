"""Tensor parallelism over gloo on CPU (tokenmill/executor, models/tensor_parallel.py).

Two ranks, one torch thread each (conftest): greedy fp32 output with
tensor_parallel_size=2 equals tensor_parallel_size=1 token for token for a dense
(Qwen3), an MoE (Qwen3-MoE) and a hybrid (Qwen3-Next: Gated DeltaNet + gated
attention + MoE with a shared expert, its grouped checkpoint layout) tiny model,
multi-head latent attention (DeepSeek-V2 / V3, latent replicated per rank), Gemma 3
and Gemma 4 (per-layer head shapes, k = v, MoE beside the dense MLP, per-layer
inputs, KV sharing), and for one KV head (replicated), biases (row-parallel ones added once) and
Phi-3's fused checkpoint tensors, with chunked prefill (16-token budget) and preemption (few KV blocks) in the mix;
a killed rank takes the engine down with EngineDeadError, no hang; bad sizes are
refused naming tensor_parallel_size.
"""
from __future__ import annotations

import os
import signal
import threading

import pytest

from conftest import (MODEL_SPECS, build_checkpoint, make_llm, make_prompts,
                      record_model_drafts, runner_of, scheduler_of)
from tokenmill import SamplingParams
from tokenmill.errors import EngineDeadError

HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

# Heads, KV heads, intermediate sizes and key heads all divide by 2; untied heads.
TP_SPECS = {
    "qwen3": ("qwen3", dict(tie_word_embeddings=False)),
    "qwen3_moe": ("qwen3_moe", dict(MOE, norm_topk_prob=True, tie_word_embeddings=False)),
    # One KV head for two ranks (replicated); tied embedding / lm_head shard.
    "qwen3_mqa": ("qwen3", dict(num_key_value_heads=1, tie_word_embeddings=True)),
    # q/k/v/o and gate/up/down biases: a row-parallel bias is added by rank 0 only.
    "llama_bias": ("llama", dict(attention_bias=True, mlp_bias=True,
                                 tie_word_embeddings=False)),
    # q/k/v and gate/up fused in the checkpoint: each segment split in place.
    "phi3_fused": ("phi3", dict(partial_rotary_factor=0.75, sliding_window=2047,
                                tie_word_embeddings=False)),
    "qwen3_next": ("qwen3_next", dict(HYBRID, **MOE, shared_expert_intermediate_size=48,
                                      decoder_sparse_step=1, norm_topk_prob=True,
                                      tie_word_embeddings=True)),
    # Multi-head latent attention: heads split (q_proj / q_b_proj, kv_b_proj, o_proj),
    # the latent projection replicated; DeepSeek MoE with shared experts; V3's low-rank
    # q and yarn.
    "deepseek_v2": MODEL_SPECS["deepseek_v2"],
    "deepseek_v3": MODEL_SPECS["deepseek_v3"],
    # Gemma 3: local and global layers, q/k norms, the gelu-tanh MLP split like a gated one.
    "gemma3": MODEL_SPECS["gemma3"],
    # Gemma 4: global layers of their own head_dim (32 vs 16), each layer's heads split
    # at its own shape.
    "gemma4": MODEL_SPECS["gemma4"],
    # Gemma 4 MoE (each expert's intermediate split, the router replicated, the experts
    # reduced apart from the dense MLP) and k = v global layers of one KV head
    # (replicated, V taken from the rank's K rows).
    "gemma4_moe_keqv": MODEL_SPECS["gemma4_moe_keqv"],
    # Everything at once: per-layer inputs (replicated), MoE, k = v, and KV-shared layers
    # reading their source's cache with the same head split.
    "gemma4_all": MODEL_SPECS["gemma4_all"],
}
# Chunked prefill (a 16-token budget splits the 33- and 40-token prompts) and
# preemption (24 blocks of 4 tokens cannot hold all six requests at full length).
ENGINE = dict(max_num_batched_tokens=16, num_kv_blocks=24, block_size=4, max_model_len=64)
PROMPT_LENGTHS = [5, 17, 33, 8, 40, 3]
# Gemma's local and global layers are two KV cache groups: a sequence takes blocks in
# both, so they get more blocks (still too few for all six requests).
ENGINE_FOR = {name: dict(ENGINE, num_kv_blocks=40) for name in TP_SPECS
              if name.startswith("gemma")}


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory):
    cache = {}

    def get(name):
        if name not in cache:
            arch, overrides = TP_SPECS[name]
            path = str(tmp_path_factory.mktemp(f"tp_{name}"))
            build_checkpoint(path, arch, overrides)
            cache[name] = path
        return cache[name]
    return get


def _greedy(llm, n: int = 12):
    prompts = [{"prompt_token_ids": p} for p in make_prompts(PROMPT_LENGTHS, 384)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _workers(llm):
    return list(runner_of(llm)._procs)


@pytest.mark.parametrize("name", list(TP_SPECS))
def test_tp2_greedy_equals_tp1(tp_model, name):
    path = tp_model(name)
    engine = ENGINE_FOR.get(name, ENGINE)
    ref_llm = make_llm(path, **engine)
    ref = _greedy(ref_llm)
    assert scheduler_of(ref_llm).num_preemptions > 0  # the mix the test is about
    llm = make_llm(path, tensor_parallel_size=2, **engine)
    procs = _workers(llm)
    try:
        assert llm.llm_engine.platform.decode_layers is False
        assert _greedy(llm) == ref
        assert scheduler_of(llm).num_preemptions > 0
        # Each rank's KV cache holds its half of the KV heads.
        spec = runner_of(llm).get_kv_cache_spec(4)
        heads = {s.num_kv_heads for s in spec.values() if hasattr(s, "num_kv_heads")}
        assert heads == {1}  # 2 KV heads split, or 1 replicated
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_tp2_async_scheduling(tp_model):
    """The worker thread of async scheduling drives the ranks the same way."""
    path = tp_model("qwen3")
    ref = _greedy(make_llm(path, **ENGINE))
    llm = make_llm(path, tensor_parallel_size=2, async_scheduling=True, **ENGINE)
    try:
        assert _greedy(llm) == ref
    finally:
        llm.llm_engine.engine_core.shutdown()


def test_killed_rank_kills_the_engine(tp_model):
    llm = make_llm(tp_model("qwen3"), tensor_parallel_size=2, **ENGINE)
    procs = _workers(llm)
    try:
        _greedy(llm, 2)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        result = {}

        def run():
            try:
                _greedy(llm, 4)
                result["ok"] = True
            except BaseException as e:  # noqa: BLE001 - inspected below
                result["error"] = e

        t = threading.Thread(target=run, daemon=True)
        t.start()
        t.join(60)
        assert not t.is_alive(), "the engine hung after a rank was killed"
        err = result.get("error")
        assert isinstance(err, EngineDeadError), result
        assert "rank 1" in str(err) and "-9" in str(err)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_rank_killed_mid_step(tp_model, monkeypatch):
    """A rank that dies while rank 0 waits in a collective fails that collective."""
    llm = make_llm(tp_model("qwen3"), tensor_parallel_size=2, **ENGINE)
    procs = _workers(llm)
    runner = runner_of(llm).runner
    model = runner.model
    orig = model.forward

    def forward(*args, **kw):  # kill the peer just before this rank's collectives
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(10)
        return orig(*args, **kw)

    monkeypatch.setattr(model, "forward", forward)
    try:
        with pytest.raises(EngineDeadError, match="rank 1"):
            _greedy(llm, 2)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("size", [0, -1, 2.0, "2", True, None])
def test_bad_tensor_parallel_size(tp_model, size):
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        make_llm(tp_model("qwen3"), tensor_parallel_size=size)


def test_heads_not_divisible(tp_model):
    # 4 attention heads, 2 KV heads: 3 ranks split neither; refused before any rank starts.
    with pytest.raises(ValueError, match="tensor_parallel_size=3 .*num_attention_heads"):
        make_llm(tp_model("qwen3"), tensor_parallel_size=3)


def test_unsupported_with_tp(tp_model):
    path = tp_model("qwen3")
    with pytest.raises(ValueError, match="tensor_parallel_size.*kv_connector"):
        make_llm(path, tensor_parallel_size=2, kv_connector="cpu")
    # MTP runs under tensor parallelism on Qwen3-Next / Qwen3.5 heads only.
    with pytest.raises(ValueError, match="speculative_config.method 'mtp' with "
                                         "tensor_parallel_size > 1 needs a Qwen3-Next / "
                                         "Qwen3.5 target .*not Qwen3ForCausalLM"):
        make_llm(path, tensor_parallel_size=2,
                 speculative_config={"method": "mtp", "num_speculative_tokens": 2})


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("name", ["qwen3", "qwen3_next"])
def test_tp2_ngram_speculation_equals_tp1(tp_model, name, async_scheduling, monkeypatch):
    """n-gram drafts under tensor parallelism: rank 0 proposes and verifies, the other
    rank runs the drafts and takes the accepted tokens (a hybrid: the state slot of the
    last accepted one) from rank 0. The lookup answers with the plain run's tokens,
    one of the first three corrupted (test_spec_oracle's "partial" oracle: drafts
    accepted and rejected in every verification pattern), with chunked prefill and
    preemption in the mix: greedy output equals the plain TP=1 run. Under async
    scheduling the step's draft slots are filled on rank 0 from its own drafts and on
    the other rank from the drafts rank 0 sent with the step before's sampled tokens."""
    from test_spec_oracle import Oracle
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    path = tp_model(name)
    prompts = make_prompts(PROMPT_LENGTHS, 384)
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)

    def run(llm):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs]

    ref = run(make_llm(path, **ENGINE))
    oracle = Oracle({tuple(p): p + r for p, r in zip(prompts, ref)}, "partial", 384)
    spec = {"method": "ngram", "num_speculative_tokens": 3}
    llm = make_llm(path, tensor_parallel_size=2, speculative_config=spec,
                   async_scheduling=async_scheduling, **ENGINE)
    assert llm.llm_engine.engine_core.async_scheduling == async_scheduling
    ngram = runner_of(llm).runner.drafter.ngram

    def lookup(index, row, length, cap):
        seq = oracle.seq_of_row(row, length)
        return oracle.drafts(seq, length, cap) if seq is not None else []
    ngram._lookup = lookup
    try:
        assert run(llm) == ref
        assert not oracle.errors, oracle.errors[:3]
        stats = scheduler_of(llm).spec_stats
        assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
        assert stats.num_accepted_tokens < stats.num_draft_tokens  # some rejected too
        assert scheduler_of(llm).num_preemptions > 0
    finally:
        llm.llm_engine.engine_core.shutdown()


def _draft_spec(path: str, method: str, root) -> dict:
    """A random-weight eagle3 / dflash draft for the target at `path` (unsharded); mtp:
    the target's own head (_with_mtp_head)."""
    import json
    from tokenmill.spec_decode import random_drafters as rd
    spec = {"method": method, "num_speculative_tokens": 3, "adaptive": False}
    if method == "mtp":
        return spec
    config = json.load(open(os.path.join(path, "config.json")))
    draft = str(root / f"{method}_{os.path.basename(path)}")
    if method == "eagle3":
        rd.build_eagle3_checkpoint(draft, config)
    else:
        rd.build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=4)
    return dict(spec, model=draft)


def _with_mtp_head(path: str, root) -> str:
    """The checkpoint at `path` with a random MTP head (mtp.*) beside its weights."""
    import json
    from tokenmill.spec_decode.random_drafters import mtp_tensors, write_folder
    config = dict(json.load(open(os.path.join(path, "config.json"))), mtp_num_hidden_layers=1)
    out = str(root / "with_mtp")
    write_folder(out, path, config, mtp_tensors(path, seed=7))
    return out


class _Rank0:
    """An LLM stand-in whose runner is rank 0's (test_spec_oracle.install_oracle)."""

    def __init__(self, llm):
        self.llm_engine = type("E", (), {})()
        self.llm_engine.engine_core = type("C", (), {"runner": runner_of(llm).runner})()


@pytest.mark.parametrize("drafts,async_scheduling", [("model", False), ("oracle", False),
                                                    ("oracle", True)])
@pytest.mark.parametrize("name,method", [("qwen3", "eagle3"), ("qwen3", "dflash"),
                                         ("qwen3_next", "eagle3"), ("qwen3_next", "dflash"),
                                         ("qwen3_next", "mtp")])
def test_tp2_draft_model_speculation_equals_tp1(tp_model, tmp_path, name, method, drafts,
                                                async_scheduling, monkeypatch):
    """A draft model under tensor parallelism runs whole on rank 0 (the target's hidden
    states complete there after the all-reduces, its embedding / lm_head gathered whole
    at load); the other rank runs the drafts as scheduled tokens. Greedy fp32 tokens
    equal the plain TP=1 engine's, logprobs within 1e-4, with chunked prefill and
    preemption: with the drafter's own drafts (equal to TP=1's with the same drafter at
    every position both proposed from) and with oracle drafts accepted part-way
    (test_spec_oracle's "partial"), the latter under async scheduling too (the other
    rank fills its draft slots from the drafts rank 0 sends)."""
    from test_spec_oracle import Oracle, install_oracle
    from tokenmill.platforms.cpu import CpuPlatform
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    path = tp_model(name) if method != "mtp" else _with_mtp_head(tp_model(name), tmp_path)
    # Rank 0's draft layers (unsharded) form KV cache groups of their own, and the
    # target's attention layers are cut to groups of as many: a token takes a block id
    # in each group (3 groups, but 2 for DFlash's two layers beside Qwen3's two), so a
    # pool just over one max_model_len sequence's blocks, which preempts.
    groups = {("qwen3", "dflash"): 2, ("qwen3_next", "mtp"): 2}.get((name, method), 3)
    engine = dict(ENGINE, num_kv_blocks=groups * 16 + 4)
    prompts = [{"prompt_token_ids": p} for p in make_prompts(PROMPT_LENGTHS, 384)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=3)
    # The hybrid's all-reduced partial sums (Gated DeltaNet, gated attention, MoE) move
    # its fp32 logprobs by up to ~1e-4 whatever the drafts: measured here, TP=2 vs TP=1
    # with the same oracle drafts, 1.0e-4 synchronous and 1.3e-4 under async scheduling
    # (the dense target: 4e-6).
    tol = 2e-4 if name == "qwen3_next" else 1e-4

    def run(llm):
        return llm.generate(prompts, params, use_tqdm=False)

    ref = run(make_llm(path, **engine))
    spec = _draft_spec(path, method, tmp_path)
    tp1 = make_llm(path, speculative_config=spec, **engine)
    tp1_drafts = record_model_drafts(runner_of(tp1))
    tp1_out = run(tp1)
    llm = make_llm(path, tensor_parallel_size=2, speculative_config=spec,
                   async_scheduling=async_scheduling, **engine)
    assert llm.llm_engine.engine_core.async_scheduling == async_scheduling
    procs = _workers(llm)
    oracle = None
    try:
        rank0 = runner_of(llm).runner
        assert rank0.draft_model is not None
        # (rank 0 writes its waiting drafter rows before cached blocks can be hit)
        assert rank0.prefix_caching is bool(scheduler_of(llm).config.enable_prefix_caching)
        assert rank0.prefix_caching
        assert type(rank0.drafter.model_proposer).__name__ in ("EagleProposer",
                                                               "DFlashProposer")
        if drafts == "oracle":
            seqs = {tuple(o.prompt_token_ids): list(o.prompt_token_ids)
                    + list(o.outputs[0].token_ids) for o in ref}
            oracle = Oracle(seqs, "partial", 384)
            install_oracle(_Rank0(llm), method, oracle, 3)
        tp2_drafts = record_model_drafts(rank0)
        got = run(llm)
        for g, w, t in zip(got, ref, tp1_out):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids == t.outputs[0].token_ids
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert list(a) == list(b)
                for tok in a:
                    assert abs(a[tok].logprob - b[tok].logprob) <= tol
        stats = scheduler_of(llm).spec_stats
        assert stats.num_draft_tokens > 0
        assert scheduler_of(llm).num_preemptions > 0
        if oracle is not None:
            assert not oracle.errors, oracle.errors[:3]
            assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        else:  # the drafter read whole hidden states and the whole embedding / lm_head
            common = tp1_drafts.keys() & tp2_drafts.keys()
            assert len(common) >= 20
            assert {k: tp2_drafts[k] for k in common} == {k: tp1_drafts[k] for k in common}
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in procs)


@pytest.mark.parametrize("name,method,async_scheduling", [("qwen3", "eagle3", False),
                                                          ("qwen3_next", "dflash", True)])
def test_tp2_suspended_requests_equal_tp1(tp_model, tmp_path, name, method, async_scheduling,
                                          monkeypatch):
    """Under a poor record (rank 0's drafter, the scheduler's copy of it) the scheduler
    takes all but every 8th request in suspended (spec_decode/drafter.py): rank 0 runs
    a step of only such requests without taps or drafter and drops their rows where
    they share a step with a scout, the other rank runs them as plain rows; the greedy
    fp32 tokens equal the plain TP=1 engine's, with chunked prefill and preemption."""
    from test_spec_suspend import watch
    from tokenmill.platforms.cpu import CpuPlatform
    from tokenmill.spec_decode.drafter import SCOUT_EVERY
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    path = tp_model(name)
    engine = dict(ENGINE, num_kv_blocks=3 * 16 + 4)  # (rank 0's draft layers: groups)
    lengths = PROMPT_LENGTHS + [9, 21, 12, 30]  # ten requests: 8 suspended, 2 scouts
    prompts = [{"prompt_token_ids": p} for p in make_prompts(lengths, 384)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref = make_llm(path, **engine).generate(prompts, params, use_tqdm=False)
    spec = dict(_draft_spec(path, method, tmp_path), adaptive=True)
    llm = make_llm(path, tensor_parallel_size=2, speculative_config=spec,
                   async_scheduling=async_scheduling, **engine)
    procs = _workers(llm)
    try:
        rank0, sched = runner_of(llm).runner, scheduler_of(llm)
        rank0.drafter.poor_record = lambda: True
        sched._draft_record_poor = True
        seen = watch(rank0, sched)
        got = llm.generate(prompts, params, use_tqdm=False)
        assert [g.outputs[0].token_ids for g in got] == [r.outputs[0].token_ids for r in ref]
        flags = list(seen["suspended"].values())
        assert flags == [i % SCOUT_EVERY != 0 for i in range(len(prompts))]
        suspended = {rid for rid, s in seen["suspended"].items() if s}
        alone = [rids for rids, _ in seen["forward"] if set(rids) <= suspended]
        assert alone  # (steps without a scout in them)
        for rids, tapped in seen["forward"]:
            assert tapped == (() if set(rids) <= suspended else rank0._aux_layer_ids)
        assert not any(set(rids) <= suspended for rids in seen["proposer"])
        assert not seen["kept"]
        assert sched.num_preemptions > 0 and not rank0.drafter._suspended
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_tp1_runs_the_runner_itself(tp_model):
    """One rank: no executor layer between the engine and its ModelRunner."""
    from tokenmill.worker.model_runner import ModelRunner
    llm = make_llm(tp_model("qwen3"))
    assert type(runner_of(llm)) is ModelRunner
    assert llm.llm_engine.platform.tensor_parallel_size == 1


def test_platform_with_tp():
    from tokenmill.platforms.cpu import CpuPlatform
    p = CpuPlatform.create("cpu", None, tensor_parallel_size=2)
    assert not p.decode_layers and p.lm_head == "full" and p.greedy_head_max_rows == 0
    assert "tensor parallel over 2 ranks" in p.describe()
    assert "tensor parallel" not in CpuPlatform.create("cpu", None).describe()


def test_cli_flag():
    from tokenmill.engine.arg_utils import engine_kwargs
    from tokenmill.entrypoints.cli import build_parser
    for argv in (["serve", "--tensor-parallel-size", "2"],
                 ["bench", "latency", "--tensor-parallel-size", "2"]):
        args = build_parser().parse_args(argv)
        assert args.tensor_parallel_size == 2
    assert engine_kwargs(build_parser().parse_args(
        ["serve", "--tensor-parallel-size", "2"]))["tensor_parallel_size"] == 2


def test_forgotten_engine_stops_its_workers(tp_model):
    """An engine dropped without shutdown: the executor's finalizer stops the ranks."""
    import gc
    llm = make_llm(tp_model("qwen3"), tensor_parallel_size=2, **ENGINE)
    procs = _workers(llm)
    _greedy(llm, 2)
    del llm
    for _ in range(40):
        gc.collect()
        if not any(p.is_alive() for p in procs):
            break
        procs[0].join(0.5)
    assert not any(p.is_alive() for p in procs)


def test_slices():
    """What a rank reads: its piece of each segment; a vocabulary shard past the end
    is zero-padded."""
    import torch

    from tokenmill.models.tensor_parallel import Split, VocabSplit
    w = torch.arange(24.0).view(12, 2)
    # q (8 rows) and k (4 rows) packed: rank 1 of 2 takes q rows 4..7 and k rows 10..11
    assert Split(0, ((8, 2, 1), (4, 2, 1))).take(w)[:, 0].tolist() == [8, 10, 12, 14, 20, 22]
    assert Split(1, ((2, 2, 0),)).take(w).shape == (12, 1)
    last = VocabSplit(vocab=11, shard=4, rank=2).take(w[:11])  # rows 8..10 + one pad row
    assert last[:, 0].tolist() == [16, 18, 20, 0]


def test_worker_exception_is_reported(tp_model, monkeypatch):
    """A rank that raises (a fault armed in the workers only: they read TOKENMILL_FAULTS
    when they start) sends its traceback, exits, and the engine dies naming it."""
    monkeypatch.setenv("TOKENMILL_FAULTS", "input=token:383")
    llm = make_llm(tp_model("qwen3"), tensor_parallel_size=2, **ENGINE)
    procs = _workers(llm)
    try:
        with pytest.raises(EngineDeadError, match="(?s)rank 1.*InjectedFault"):
            llm.generate([{"prompt_token_ids": [383, 5, 6]}],
                         SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
    assert not any(p.is_alive() for p in procs)


def test_layers_declare_their_splits(tp_model):
    """What a rank reads and where the ranks' partial sums meet come from the layers'
    declarations (Linear roles, tp_plan, tp_reduces), read on a Qwen3-Next rank built on
    the meta device: packed q|k|v by heads, Gated DeltaNet's sections by key heads, the
    experts' intermediate dim; one all-reduce per block, the MoE block's for its experts
    and shared expert both."""
    import json

    import torch

    from tokenmill.models import tensor_parallel as tp
    from tokenmill.models.registry import resolve_model_class
    with open(f"{tp_model('qwen3_next')}/config.json") as f:
        cfg = json.load(f)
    cls = resolve_model_class(cfg)
    with torch.device("meta"):
        model = cls(tp.rank_config(cfg, 2, cls))
    rules = tp.ShardPlan(model, cfg, rank=1, size=2).rules
    attn = next(i for i, layer in enumerate(model.layers) if not layer.is_linear)
    q = 2 * cfg["num_attention_heads"] * 16  # q and gate rows, 16 per head
    pre = f"layers.{attn}.self_attn"
    assert rules[(f"{pre}.qkv_proj.weight", 0)] == tp.Split(0, ((q, 2, 1),))
    assert rules[(f"{pre}.qkv_proj.weight", None)].segments[0] == (q, 2, 1)
    assert rules[(f"{pre}.o_proj.weight", None)] == tp.Split(1, ((q // 2, 2, 1),))
    kd, vd = 2 * 16, 4 * 8  # key heads x key dim, value heads x value dim
    assert rules[("layers.0.linear_attn.in_proj.weight", 0)] == tp.Split(
        0, ((kd, 2, 1), (kd, 2, 1), (vd, 2, 1)))
    assert rules[("layers.0.linear_attn.dt_bias", None)] == tp.Split(0, ((4, 2, 1),))
    assert rules[("layers.0.mlp.experts.gate_up_proj", None)] == tp.Split(
        1, ((32, 2, 1), (32, 2, 1)))
    assert ("layers.0.mlp.gate.weight", None) not in rules  # the router: replicated

    class Group:
        rank = 0

        def all_reduce(self, x):
            return x

    tp.shard_model(model, Group(), cfg["vocab_size"])
    reducing = {name for name, m in model.named_modules() if m._forward_hooks}
    assert reducing == ({f"layers.{i}.mlp" for i in range(len(model.layers))}
                        | {f"layers.{i}.self_attn.o_proj" for i in range(len(model.layers))
                           if not model.layers[i].is_linear}
                        | {f"layers.{i}.linear_attn.out_proj" for i in range(len(model.layers))
                           if model.layers[i].is_linear} | {"lm_head"})
