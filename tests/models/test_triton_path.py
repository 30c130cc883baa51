"""The CUDA path's plumbing, proven on the CPU: the engine with the Triton attention
kernels (run by Triton's interpreter on CPU tensors) and with the decode-graph runner
(its graphs "replayed" eagerly over the static, padded buffers) gives the same greedy
tokens as the PyTorch path. Tiny model, few tokens: the interpreter is slow."""
import dataclasses
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402

from conftest import (HEAD_SHAPE_SPECS, TINY, TinyModel, build_checkpoint,  # noqa: E402
                      hf_greedy, make_llm, make_prompts, record_model_drafts, runner_of)
from tokenmill import SamplingParams, platforms  # noqa: E402
from tokenmill.platforms.cpu import CpuPlatform  # noqa: E402

pytest.importorskip("triton")

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def triton_model(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            arch, overrides = HEAD_SHAPE_SPECS[name]
            path = str(tmp_path_factory.mktemp(name))
            built[name] = TinyModel(name, path, arch, build_checkpoint(path, arch, overrides))
        return built[name]

    return get


def _hf_capped(monkeypatch):
    """transformers' Gemma 3 keeps attn_logit_softcapping on the layer but never hands
    it to the attention function, so HF's scores stay uncapped; its own eager attention
    caps Gemma 2 style when given `softcap`: give it the layer's, for the reference."""
    from transformers.models.gemma3 import modeling_gemma3 as hf_gemma3
    eager = hf_gemma3.eager_attention_forward

    def capped(module, *a, **k):
        return eager(module, *a, **dict(k, softcap=module.attn_logit_softcapping))

    monkeypatch.setattr(hf_gemma3, "eager_attention_forward", capped)


def _generate(path, prompts, **kw):
    llm = make_llm(path, cpu_kernels="torch", **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.fixture
def triton_platform(monkeypatch):
    """The CPU platform with the attention decision CUDA makes."""
    make = platforms.from_engine_args

    def with_triton(args, device, dtype):
        return dataclasses.replace(make(args, device, dtype), attention="triton")

    monkeypatch.setattr(platforms, "from_engine_args", with_triton)


class NoHostReads(TorchFunctionMode):
    """Fails on what a CUDA graph capture refuses: a host read of a tensor's values
    (on a CUDA stream each waits for the GPU), a shape that depends on values (a
    boolean mask as an index, nonzero, unique), a device tensor made from host data
    (a copy from pageable memory; a CPU scalar such as Gemma's embedding scale is
    fine, its value becomes a kernel argument). A torch function mode, so
    torch.Tensor itself is left untouched."""

    REFUSED = {"item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__",
               "__index__", "nonzero", "argwhere", "unique", "unique_consecutive",
               "bincount", "masked_select"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in self.REFUSED or (name in ("tensor", "as_tensor") and "device" in kwargs):
            raise AssertionError(f"{name} in a graphed decode step")
        if name == "__getitem__":
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                raise AssertionError("boolean-mask index in a graphed decode step")
        return func(*args, **kwargs)


class _EagerGraph:
    """Stands in for a captured graph: replay runs the model over the static buffers,
    refusing any host read of a value, as a capture would, into static outputs (the
    hidden states and, for a drafter, the taps)."""

    def __init__(self, model, ids, pos, meta, out, taps=None):
        self.model, self.ids, self.pos, self.meta, self.out = model, ids, pos, meta, out
        self.taps = taps
        self.replays = 0
        self.rows_used = []  # the real rows of each replay (the rest pad rows)

    def replay(self):
        self.replays += 1
        with NoHostReads():
            self.out.copy_(self.model(self.ids, self.pos, self.meta))
        if self.taps is not None:
            self.taps.copy_(self.model.aux_hidden)
        self.model.aux_hidden = None  # the runner must hand the drafter the static taps


@pytest.fixture
def eager_graphs(monkeypatch, triton_platform):
    from tokenmill.worker import cuda_graph
    from tokenmill.worker.model_runner import ModelRunner

    def capture(self, progress=False):
        buf = self.buffers
        hidden = self.model.config.hidden_size
        for size in self.sizes:
            meta = buf.metadata(size)
            out = torch.empty(size, hidden, dtype=self.model.embed_tokens.weight.dtype)
            taps = None
            if getattr(self.model, "aux_layer_ids", ()):  # a drafter's: as record_taps
                buf.make_inert(size)
                self.model(buf.input_ids[:size], buf.positions[:size], meta)
                taps = self.model.aux_hidden.clone()
                self.taps[size] = taps
            self.graphs[size] = (_EagerGraph(self.model, buf.input_ids[:size],
                                             buf.positions[:size], meta, out, taps), out)
        real_fill = buf.fill

        def fill(size, input_ids, *a):
            self.graphs[size][0].rows_used.append(input_ids.shape[0])
            return real_fill(size, input_ids, *a)
        buf.fill = fill

    monkeypatch.setattr(cuda_graph.DecodeGraphRunner, "capture", capture)
    monkeypatch.setattr(ModelRunner, "_cuda_graphs_apply", lambda self: True)
    return monkeypatch


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mistral_swa"])
def test_triton_attention_engine_matches_pytorch_path(tiny_model_factory, triton_platform,
                                                      name):
    """Mixed steps (decodes beside prompt chunks of 8 tokens: chunked prefill over a
    cached prefix) and, for mistral_swa, a window of 12 smaller than the sequences."""
    tm = tiny_model_factory(name)
    prompts = [tm.prompts[0][:5], tm.prompts[1][:19], tm.prompts[2][:11]]
    got, llm = _generate(tm.path, prompts, max_num_batched_tokens=8)
    runner = llm.llm_engine.engine_core.runner
    assert {b.name for b in runner.attn_backends.values()} == {"triton"}
    assert runner.last_attn_meta.slot_mapping is not None
    for p, g in zip(prompts, got):
        assert g == tm.reference(p, len(g)), name


@pytest.mark.parametrize("name", ["llama_gqa_tied", "gemma3", "gemma3_softcap"])
def test_decode_graphs_replayed_over_padded_buffers_match(tiny_model_factory, triton_model,
                                                          eager_graphs, name):
    """Three requests decode together: each step pads 3 -> 4 rows (an inert pad row
    beside them) and, as they finish at different lengths, 2 -> 2 and 1 -> 1. Gemma 3:
    two KV cache groups (local and global layers), each with its own static buffers;
    soft-capped, its decode steps are graphed too (all layers on the kernels)."""
    if name in HEAD_SHAPE_SPECS:
        tm = triton_model(name)
        _hf_capped(eager_graphs)
    else:
        tm = tiny_model_factory(name)
    prompts = [tm.prompts[0][:5], tm.prompts[1][:9], tm.prompts[2][:7]]
    llm = make_llm(tm.path, cpu_kernels="torch", max_num_seqs=4)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6, 8)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    runner = llm.llm_engine.engine_core.runner
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4]
    assert set(graphs.buffers.groups) == set(runner.attn_group_ids)
    assert len(runner.attn_group_ids) == (1 if name == "llama_gqa_tied" else 2)
    assert graphs.graphs[4][0].replays > 0  # the padded size ran
    for cache in runner.kv_caches.values():  # pad rows wrote nowhere, not even the null block
        assert not cache[0].any()
    for p, o, sp in zip(prompts, outs, params):
        assert o.outputs[0].token_ids == tm.reference(p, sp.max_tokens)


def test_triton_decode_serves_rows_verifying_drafts(tiny_model_factory, triton_platform,
                                                    monkeypatch):
    """n-gram speculation: a verifying row's tokens are decode queries of their own
    lengths (the block table repeated per token): same tokens as without drafts."""
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    tm = tiny_model_factory("llama_gqa_tied")
    motif = tm.prompts[3][:3]
    prompts = [tm.prompts[0][:4] + motif * 3, tm.prompts[1][:6]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    llm = make_llm(tm.path, cpu_kernels="torch",
                   speculative_config=dict(method="ngram", num_speculative_tokens=3,
                                           prompt_lookup_max=3, prompt_lookup_min=1))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.spec_stats.num_drafts > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == tm.reference(p, 10)


def _replayed_rows(runner) -> list[int]:
    """The real rows of every replay, over every graph size."""
    return [n for graph, _ in runner.cuda_graphs.graphs.values() for n in graph.rows_used]


def test_verify_steps_replay_the_decode_graphs(tiny_model_factory, eager_graphs):
    """n-gram speculation with decode graphs: a verify step's tokens are decode queries
    of their own, so a step of T tokens (1 + k a verifying row) replays the graph of
    the smallest size >= T, its pad rows inert. The sizes cover max_num_seqs x (1 + k);
    tokens equal HF's, and tokens and logprobs equal the eager PyTorch path's."""
    eager_graphs.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    tm = tiny_model_factory("llama_gqa_tied")
    motif = tm.prompts[3][:3]
    prompts = [tm.prompts[0][:4] + motif * 3, tm.prompts[1][:6], tm.prompts[2][:2] + motif * 2]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2)
    spec = dict(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                prompt_lookup_min=1)

    def run():
        llm = make_llm(tm.path, cpu_kernels="torch", max_num_seqs=4, speculative_config=spec)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.engine_core.scheduler.spec_stats.num_drafts > 0
        return [o.outputs[0] for o in outs], runner_of(llm)

    got, runner = run()
    assert runner.cuda_graphs.sizes == [1, 2, 4, 8, 16]  # 4 seqs x (1 + 3)
    rows = _replayed_rows(runner)
    assert max(rows) > len(prompts)  # verify steps (more queries than requests) replayed
    for p, o in zip(prompts, got):
        assert o.token_ids == tm.reference(p, 10)
    eager_graphs.undo()  # the PyTorch path, no Triton, no graphs
    eager_graphs.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    want, runner = run()
    assert runner.cuda_graphs is None
    _assert_same_logprobs(got, want)


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_drafters_read_their_taps_from_the_graphs(tiny_model_factory, eager_graphs, tmp_path,
                                                  method):
    """EAGLE-3 and DFlash read the target's taps (model.aux_hidden) of each step: with
    the steps replayed from graphs they come from the graphs' static tap outputs (the
    stand-in clears model.aux_hidden after a replay, so a runner that forgot them
    fails). Every proposal equals the eager path's, and so do the tokens."""
    import json

    from tokenmill.spec_decode import random_drafters as rd
    eager_graphs.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    tm = tiny_model_factory("llama_gqa_tied")
    config = json.load(open(os.path.join(tm.path, "config.json")))
    draft = str(tmp_path / method)
    os.makedirs(draft)
    if method == "eagle3":
        rd.build_eagle3_checkpoint(draft, config)
    else:
        rd.build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=4)
    spec = dict(method=method, num_speculative_tokens=3, model=draft, adaptive=False)
    prompts = [tm.prompts[0][:7], tm.prompts[1][:5], tm.prompts[2][:9]]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def run():
        llm = make_llm(tm.path, cpu_kernels="torch", max_num_seqs=4, speculative_config=spec)
        drafts = record_model_drafts(runner_of(llm), strict=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], drafts, runner_of(llm)

    got, drafts, runner = run()
    assert runner.cuda_graphs.taps  # the graphs write the taps
    assert max(_replayed_rows(runner)) > len(prompts)  # verify steps replayed
    assert drafts
    for p, g in zip(prompts, got):
        assert g == tm.reference(p, 8)
    eager_graphs.undo()
    eager_graphs.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    want, want_drafts, runner = run()
    assert runner.cuda_graphs is None
    assert got == want and drafts == want_drafts


def test_hybrid_verify_steps_run_eagerly_beside_graphed_decodes(tmp_path, eager_graphs):
    """Qwen3.5 with n-gram drafts: a verify step's recurrent layers take each row's
    tokens in order, a state slot each (host lists): such steps run eagerly, steps
    without drafts replay; same tokens and logprobs as the PyTorch path without
    graphs."""
    from test_hybrid_parity import HYBRID_SPECS, build_hybrid
    arch, overrides = HYBRID_SPECS["qwen3_5"]
    build_hybrid(str(tmp_path), arch, overrides)
    motif = make_prompts([3], TINY["vocab_size"], seed=12)[0]
    prompts = [p + motif * 3 for p in make_prompts([4, 6], TINY["vocab_size"], seed=11)]
    prompts.append(make_prompts([5], TINY["vocab_size"], seed=13)[0])
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    spec = dict(method="ngram", num_speculative_tokens=2, prompt_lookup_max=3,
                prompt_lookup_min=1)
    eager = []

    def run():
        llm = make_llm(str(tmp_path), cpu_kernels="torch", max_num_seqs=4,
                       speculative_config=spec)
        runner = runner_of(llm)
        real = runner.model.forward

        def forward(ids, pos, meta, **kw):  # the eager forwards of verify steps
            if meta.state is not None and meta.state.decode_steps is not None:
                eager.append(ids.shape[0])
            return real(ids, pos, meta, **kw)
        runner.model.forward = forward
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert llm.llm_engine.engine_core.scheduler.spec_stats.num_drafts > 0
        return [o.outputs[0] for o in outs], runner

    got, runner = run()
    assert eager and _replayed_rows(runner)  # both kinds of step ran
    assert max(_replayed_rows(runner)) <= len(prompts)  # no verify step in a graph
    eager_graphs.undo()
    want, runner = run()
    assert runner.cuda_graphs is None
    _assert_same_logprobs(got, want)


def _assert_same_logprobs(got, want, tol=1e-4):
    """Same tokens, and each position's top logprobs within `tol`."""
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for lg, lw in zip(g.logprobs, w.logprobs):
            assert lg.keys() == lw.keys()
            for t in lg:
                assert abs(lg[t].logprob - lw[t].logprob) < tol


def test_eagle3_drafter_runs_the_triton_kernels(tiny_model_factory, triton_platform,
                                                tmp_path, monkeypatch):
    """An EAGLE-3 drafter builds its metadata through the runner's builder, so its K/V
    writes and decode steps take the Triton kernels the platform chose for the target
    (they fell back to the PyTorch path): same tokens as without speculation."""
    import json

    from tokenmill.ops import triton_attention
    from tokenmill.spec_decode.random_drafters import build_eagle3_checkpoint
    monkeypatch.setattr(CpuPlatform, "fast_decode_rows", property(lambda self: None))
    tm = tiny_model_factory("llama_gqa_tied")
    draft = str(tmp_path / "eagle3")
    os.makedirs(draft)
    build_eagle3_checkpoint(draft, json.load(open(os.path.join(tm.path, "config.json"))))
    prompts = [tm.prompts[0][:7], tm.prompts[1][:5]]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    llm = make_llm(tm.path, cpu_kernels="torch", speculative_config=dict(
        method="eagle3", num_speculative_tokens=2, model=draft, adaptive=False))
    runner = runner_of(llm)
    draft_layer = runner.draft_model.attention_layers()[0]
    assert draft_layer.impl.ops is triton_attention
    calls = {"write": 0, "decode": 0}
    for name, key in (("write_kv", "write"), ("paged_decode", "decode")):
        real = getattr(triton_attention, name)

        def counting(*a, _real=real, _key=key, **k):
            calls[_key] += 1
            return _real(*a, **k)
        monkeypatch.setattr(triton_attention, name, counting)
    seen = []
    real_write = draft_layer.write_kv
    monkeypatch.setattr(draft_layer, "write_kv",
                        lambda k, v, meta: (seen.append(meta.slot_mapping), real_write(k, v, meta)))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert llm.llm_engine.engine_core.scheduler.spec_stats.num_drafts > 0
    # The drafter's metadata came from the Triton builder: its flat slot mapping is there.
    assert seen and all(slots is not None for slots in seen)
    assert calls["write"] > 0 and calls["decode"] > 0
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == tm.reference(p, 5)


def test_hybrid_decode_graphs_use_a_scratch_state_slot(tmp_path, eager_graphs):
    """Qwen3.5 (Gated DeltaNet + attention): the pad rows' recurrent state goes to the
    scratch slot after the real ones; same tokens as the PyTorch path without graphs,
    and no live request's state is touched by a pad row."""
    from test_hybrid_parity import HYBRID_SPECS, build_hybrid
    arch, overrides = HYBRID_SPECS["qwen3_5"]
    build_hybrid(str(tmp_path), arch, overrides)
    prompts = make_prompts([5, 9, 3], TINY["vocab_size"], seed=8)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6, 8)]

    def run(**kw):
        llm = make_llm(str(tmp_path), cpu_kernels="torch", max_num_seqs=4, **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.llm_engine.engine_core.runner

    got, runner = run()
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.buffers.pad_state_slot == 4 * 1  # 4 seqs, width 1
    # 4 request slots, the scratch slot, then hybrid prefix caching's snapshot slots
    assert runner.snapshot_base == 5
    snapshots = runner.kv_cache_config.num_state_snapshots
    assert all(t[0].shape[0] == 5 + snapshots for t in runner.state_caches.values())
    assert graphs.graphs[4][0].replays > 0
    eager_graphs.undo()  # the PyTorch path, no Triton, no graphs
    want, runner = run()
    assert runner.cuda_graphs is None
    assert got == want


@pytest.mark.parametrize("name", list(HEAD_SHAPE_SPECS))
def test_triton_kernels_serve_head_96_512_and_soft_capping(triton_model, triton_platform,
                                                           monkeypatch, name):
    """Every attention layer on the kernels (none left on the PyTorch path): head size
    96 in a 128 block with its tail masked, 512 beside 16 (Gemma 4), or soft-capped
    scores in decode and prefill (with a window on Gemma's local layers); mixed steps
    of 8-token chunks over a cached prefix. Greedy tokens equal HF's (soft-capped as Gemma 2 caps: _hf_capped)."""
    from tokenmill.ops import triton_attention as ta
    caps = []
    for fn in ("paged_decode", "paged_prefill"):
        def spy(*a, _fn=getattr(ta, fn), _name=fn, **k):
            caps.append((_name, a[1].shape[-1], k.get("softcap", 0.0)))
            return _fn(*a, **k)
        monkeypatch.setattr(ta, fn, spy)
    tm = triton_model(name)
    prompts = make_prompts([5, 19, 11], tm.vocab_size, seed=2)
    got, llm = _generate(tm.path, prompts, max_num_batched_tokens=8)
    runner = llm.llm_engine.engine_core.runner
    layers = runner.attention_layers().values()
    assert {b.name for b in runner.attn_backends.values()} == {"triton"}
    assert all(type(lay.impl).__name__ == "TritonAttentionImpl" for lay in layers)
    cap = 2.0 if name == "gemma3_softcap" else 0.0
    heads = {"phi3_hd96": {96}, "gemma4_hd512": {16, 512}, "gemma3_softcap": {32}}[name]
    assert {c[0] for c in caps} == {"paged_decode", "paged_prefill"}
    assert {c[1:] for c in caps} == {(h, cap) for h in heads}
    if cap:
        uncapped = [hf_greedy(tm.hf, p, len(g)) for p, g in zip(prompts, got)]
        assert got != uncapped  # the cap changes the tokens: the comparison sees it
        _hf_capped(monkeypatch)
    for p, g in zip(prompts, got):
        assert g == tm.reference(p, len(g)), name


def test_hybrid_on_fla_and_triton_kernels_matches_pytorch_path(tmp_path, eager_graphs,
                                                               fla_interpreted):
    """Qwen3.5 on the whole CUDA kernel set at once, each run by the interpreter:
    flash-linear-attention's chunked kernels for prompt chunks and its fused recurrent
    kernel for decode rows, Triton attention, decode graphs over padded buffers. A
    150-token prompt prefills in three chunks beside decoding rows; same tokens as
    the PyTorch delta rule on the same path."""
    from test_hybrid_parity import HYBRID_SPECS, build_hybrid
    from tokenmill.models.layers.gated_deltanet import GatedDeltaNet
    arch, overrides = HYBRID_SPECS["qwen3_5"]
    build_hybrid(str(tmp_path), arch, dict(overrides, linear_key_head_dim=32,
                                           linear_value_head_dim=16))
    prompts = make_prompts([150, 9, 3], TINY["vocab_size"], seed=9)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (4, 6, 8)]
    chunk, fused = fla_interpreted
    calls = {"chunk": 0, "fused": 0}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return call

    def run(fla: bool):
        llm = make_llm(str(tmp_path), cpu_kernels="torch", max_num_seqs=4, max_model_len=192,
                       max_num_batched_tokens=64)
        layers = [m for m in runner_of(llm).model.modules() if isinstance(m, GatedDeltaNet)]
        assert len(layers) == 3
        for layer in layers:  # what the platform does on CUDA ("fla" where it imports)
            layer.set_linear_attention("fla" if fla else "torch",
                                       (counted("chunk", chunk), counted("fused", fused)))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        graphs = runner_of(llm).cuda_graphs.graphs.values()
        assert any(graph.replays for graph, _ in graphs)  # decode steps replayed
        return [o.outputs[0].token_ids for o in outs]

    got = run(fla=True)
    assert calls["chunk"] >= 3 * 3 and calls["fused"] > 0  # 3 DeltaNet layers, 3 chunks
    calls.update(chunk=0, fused=0)
    want = run(fla=False)
    assert calls == {"chunk": 0, "fused": 0}
    assert got == want


def test_moe_decode_graphs_with_sync_free_experts(tmp_path, eager_graphs):
    """Qwen3-MoE (top-1 of 16: most experts idle in a step) with the experts as CUDA
    runs them (SyncFreeFusedMoEMethod, the CUDA platform's choice): graphed decode steps
    read nothing on the host and give the tokens of the PyTorch path without graphs."""
    from test_moe_parity import MOE_SPECS
    from tokenmill.models.layers.linear_methods import (SyncFreeFusedMoEMethod,
                                                        UnquantizedFusedMoEMethod)
    from tokenmill.models.layers.moe import FusedMoE
    arch, overrides = MOE_SPECS["qwen3_moe_top1"]
    build_checkpoint(str(tmp_path), arch, overrides)
    prompts = make_prompts([5, 9, 7], TINY["vocab_size"], seed=10)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (3, 6, 8)]

    def run(sync_free: bool):
        llm = make_llm(str(tmp_path), cpu_kernels="torch", max_num_seqs=4)
        runner = runner_of(llm)
        experts = [m for m in runner.model.modules() if isinstance(m, FusedMoE)]
        assert experts
        for m in experts:
            m.set_method(SyncFreeFusedMoEMethod() if sync_free else UnquantizedFusedMoEMethod())
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], runner

    got, runner = run(sync_free=True)
    assert runner.cuda_graphs.graphs[4][0].replays > 0
    eager_graphs.undo()
    want, runner = run(sync_free=False)
    assert runner.cuda_graphs is None
    assert got == want
