"""The CUDA path against the CPU: greedy tokens on CUDA (fp32) equal the CPU's fp32
tokens of the same tiny checkpoints, for dense, sliding-window, multi-group, MoE
and hybrid models, head sizes 96 and 512 and soft-capped attention; with and
without decode CUDA graphs; with chunked prefill and under preemption. Skipped
without CUDA (scripts/gpu_check.sh runs them on a GPU).

The CPU side is tokenmill's PyTorch path in fp32 (tests/models/test_cpu_paths.py
ties it to HF); the CUDA side runs Triton attention (TF32 off: the kernels use IEEE fp32
products, and torch's matmuls are told to as well)."""
from __future__ import annotations

import pytest
import torch

from conftest import (HEAD_SHAPE_SPECS, TINY, build_checkpoint, make_llm, make_prompts,
                      preempt_pool, scheduler_of)
from tokenmill import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
HYBRID = dict(num_hidden_layers=4, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
              linear_conv_kernel_dim=4)
# name -> (architecture, overrides on conftest.TINY)
GPU_SPECS = {
    "llama_gqa_tied": ("llama", dict(tie_word_embeddings=True)),
    "qwen3_headdim": ("qwen3", dict(head_dim=32, tie_word_embeddings=False)),
    "mistral_swa": ("mistral", dict(head_dim=32, sliding_window=12, tie_word_embeddings=False)),
    "gemma3": ("gemma3", dict(num_hidden_layers=4, head_dim=32, sliding_window=12,
                              sliding_window_pattern=2, query_pre_attn_scalar=24,
                              final_logit_softcapping=30.0, tie_word_embeddings=True)),
    "qwen3_moe": ("qwen3_moe", dict(MOE, norm_topk_prob=True, num_hidden_layers=3,
                                    decoder_sparse_step=1, mlp_only_layers=[0],
                                    tie_word_embeddings=False)),
    "qwen3_5": ("qwen3_5", dict(HYBRID, tie_word_embeddings=False)),
}
LENGTHS = [5, 33, 1, 70, 17, 2, 48, 9]
NUM_NEW = 12


@pytest.fixture(scope="module", autouse=True)
def ieee_fp32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    built = {}

    def get(name):
        if name not in built:
            arch, overrides = {**GPU_SPECS, **HEAD_SHAPE_SPECS}[name]
            path = str(tmp_path_factory.mktemp(name))
            with torch.device("cpu"):
                build_checkpoint(path, arch, overrides)
            built[name] = path
        return built[name]

    return get


def _greedy(path, device, prompts, **kw):
    llm = make_llm(path, device=device, max_num_seqs=8, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True),
                        use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], llm


_cpu_refs: dict = {}


def _cpu_reference(path, prompts, **kw):
    key = (path, tuple(map(tuple, prompts)), tuple(sorted(kw.items())))
    if key not in _cpu_refs:  # (the PyTorch CPU path: no native build on the GPU box)
        _cpu_refs[key] = _greedy(path, "cpu", prompts, cpu_kernels="torch", **kw)[0]
    return _cpu_refs[key]


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("name", list(GPU_SPECS))
def test_cuda_greedy_equals_cpu(checkpoint, name, eager):
    path = checkpoint(name)
    prompts = make_prompts(LENGTHS, TINY["vocab_size"], seed=3)
    got, llm = _greedy(path, "cuda", prompts, enforce_eager=eager)
    runner = llm.llm_engine.engine_core.runner
    assert {b.name for b in runner.attn_backends.values()} == {"triton"}
    assert (runner.cuda_graphs is None) == eager  # decode steps replayed unless eager
    assert got == _cpu_reference(path, prompts)


@pytest.mark.parametrize("name", list(HEAD_SHAPE_SPECS))
def test_cuda_head_sizes_and_softcap_equal_cpu(checkpoint, name):
    """Head sizes 96 and 512 (masked tails) and soft-capped attention on the kernels,
    every layer: decode steps replayed from graphs, prompts in 16-token chunks."""
    path = checkpoint(name)
    prompts = make_prompts(LENGTHS, TINY["vocab_size"], seed=5)
    got, llm = _greedy(path, "cuda", prompts, max_num_batched_tokens=16)
    runner = llm.llm_engine.engine_core.runner
    assert runner.cuda_graphs is not None
    assert {b.name for b in runner.attn_backends.values()} == {"triton"}
    assert all(type(layer.impl).__name__ == "TritonAttentionImpl"
               for layer in runner.attention_layers().values())
    assert got == _cpu_reference(path, prompts, max_num_batched_tokens=16)


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mistral_swa", "qwen3_moe", "qwen3_5"])
def test_cuda_chunked_prefill_equals_cpu(checkpoint, name):
    """Prompts split into 8-token chunks: prefill over a cached prefix, mixed steps."""
    path = checkpoint(name)
    prompts = make_prompts(LENGTHS, TINY["vocab_size"], seed=4)
    got, _ = _greedy(path, "cuda", prompts, max_num_batched_tokens=8)
    assert got == _cpu_reference(path, prompts)


@pytest.mark.parametrize("name", ["llama_gqa_tied", "mistral_swa", "qwen3_moe"])
def test_cuda_preemption_equals_cpu(checkpoint, name):
    """A KV pool that holds two full-length sequences: requests are preempted and
    recomputed; same tokens, every block back at the end."""
    path = checkpoint(name)
    prompts = make_prompts([60, 70, 50, 65], TINY["vocab_size"], seed=6)
    kw = preempt_pool(name, dict(max_model_len=96, block_size=8, num_kv_blocks=25))
    kw.pop("max_model_len")
    got, llm = _greedy(path, "cuda", prompts, max_model_len=96, **kw)
    sched = scheduler_of(llm)
    assert sched.num_preemptions > 0, "the pool was meant to force preemption"
    assert sched.kv_cache_manager.num_used_blocks == 0
    assert got == _cpu_reference(path, prompts, max_model_len=96)


def _ref_rows(q, cache, table, qpos, scale, window, softcap):
    """Queries q [M, Hq, D] of one request at positions qpos [M], fp32 reference."""
    bs, hkv, hq = cache.shape[2], cache.shape[3], q.shape[1]
    pos = torch.arange(int(qpos.max()) + 1, device=q.device)
    blk = table[pos // bs].long()
    k = cache[blk, 0, pos % bs].float().repeat_interleave(hq // hkv, 1)
    v = cache[blk, 1, pos % bs].float().repeat_interleave(hq // hkv, 1)
    s = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    visible = pos[None, :] <= qpos[:, None]
    if window:
        visible &= pos[None, :] > qpos[:, None] - window
    return torch.einsum("hmn,nhd->mhd", s.masked_fill(~visible, float("-inf")).softmax(-1), v)


@pytest.mark.parametrize("d,softcap", [(128, 0.0), (96, 0.0), (512, 0.0), (80, 5.0),
                                       (128, 5.0)])
def test_triton_kernels_on_the_gpu_match_the_interpreter_reference(d, softcap):
    """The kernel tests of tests/unit/test_triton_attention.py, compiled for the GPU (bf16
    included, which the interpreter cannot check): decode (4 rows x 2 KV heads take
    split-K, and the single pass), prefill over a cached prefix, masked head tails
    (96, 80, 512) and soft-capping."""
    from tokenmill.ops import triton_attention as ta
    dev = "cuda"
    bs, hkv, hq, nb = 16, 2, 8, 64
    scale = d ** -0.5 * (4 if softcap else 1)
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 2e-2)):
        cache = torch.randn(nb, 2, bs, hkv, d, generator=g).to(dev, dtype)
        lens = torch.tensor([1, 37, 200, 0], dtype=torch.int32, device=dev)
        table = torch.randperm(nb - 1, generator=g)[:4 * 13].add(1).view(4, 13).to(dev, torch.int32)
        q = torch.randn(4, hq, d, generator=g).to(dev, dtype)
        for window, splits in ((0, None), (24, None), (0, 1), (24, 1)):  # None: split-K here
            out = ta.paged_decode(q, cache, table, lens, scale, window, num_splits=splits,
                                  softcap=softcap)
            for r, n in enumerate(lens.tolist()):
                if n == 0:
                    assert out[r].abs().max() == 0
                    continue
                ref = _ref_rows(q[r:r + 1], cache, table[r], torch.tensor([n - 1], device=dev),
                                scale, window, softcap)
                torch.testing.assert_close(out[r].float(), ref[0], atol=tol, rtol=tol)
        # prefill: 40 queries after 160 cached tokens (row 2's blocks), and a fresh 7
        qp = torch.randn(47, hq, d, generator=g).to(dev, dtype)
        qsl = torch.tensor([0, 40, 47], device=dev)
        plens = torch.tensor([200, 7], dtype=torch.int32, device=dev)
        ptable = table[2:4].clone()
        ptable[1] = table[1]
        for window in (0, 24):
            out = ta.paged_prefill(qp, cache, ptable, qsl, plens, 40, scale, window,
                                   softcap=softcap)
            for r, (s0, e0, ctx) in enumerate(((0, 40, 160), (40, 47, 0))):
                qpos = torch.arange(ctx, ctx + e0 - s0, device=dev)
                ref = _ref_rows(qp[s0:e0], cache, ptable[r], qpos, scale, window, softcap)
                torch.testing.assert_close(out[s0:e0].float(), ref, atol=tol, rtol=tol)


@torch.inference_mode()  # (as the engine runs: the layers' parameters require grad)
def test_sync_free_moe_on_the_gpu():
    """The CUDA experts (torch._grouped_mm in bf16 on compute capability 9.0+, else the
    gathered bmm) against the fp32 stacked-expert path on the CPU."""
    from tokenmill.models.layers.linear_methods import SyncFreeFusedMoEMethod
    from tokenmill.models.layers.moe import FusedMoE, route
    g = torch.Generator().manual_seed(0)
    moe = FusedMoE(16, 256, 128)
    with torch.no_grad():
        moe.gate_up_proj.copy_(torch.randn(moe.gate_up_proj.shape, generator=g) * 0.05)
        moe.down_proj.copy_(torch.randn(moe.down_proj.shape, generator=g) * 0.05)
    x = torch.randn(77, 256, generator=g)
    weights, ids = route(torch.randn(77, 16, generator=g), 4, True)
    ref = moe(x, weights, ids)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 3e-2)):
        gpu = FusedMoE(16, 256, 128).to("cuda", dtype)
        gpu.load_state_dict(moe.state_dict())
        gpu.set_method(SyncFreeFusedMoEMethod())
        got = gpu(x.to("cuda", dtype), weights.to("cuda", dtype), ids.cuda())
        torch.testing.assert_close(got.float().cpu(), ref, atol=tol, rtol=tol)


def test_fla_kernels_match_the_pytorch_delta_rule():
    """flash-linear-attention's kernels through the layer's wrappers (what a bf16 / fp16
    hybrid model runs on CUDA) against the PyTorch delta rule, in fp32 inputs."""
    from conftest import import_fla_kernels  # fla is hidden from transformers
    from tokenmill.models.layers import gated_deltanet as gdn
    chunk, fused = import_fla_kernels()
    gen = torch.Generator().manual_seed(0)
    t, h, dk, dv = 150, 4, 64, 64
    q = gdn.l2_normalize(torch.randn(t, h, dk, generator=gen)) * dk ** -0.5
    k = gdn.l2_normalize(torch.randn(t, h, dk, generator=gen))
    v, g, beta = (torch.randn(t, h, dv, generator=gen), -torch.rand(t, h, generator=gen),
                  torch.rand(t, h, generator=gen))
    state = torch.randn(h, dv, dk, generator=gen) * 0.1
    ref_out, ref_final = gdn.delta_rule_chunked(q, k, v, g, beta, state)
    out, final = gdn.fla_chunked(chunk, *(x.cuda() for x in (q, k, v, g, beta, state)))
    torch.testing.assert_close(out.cpu(), ref_out, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(final.float().cpu(), ref_final, atol=2e-2, rtol=2e-2)
    states = torch.randn(5, h, dv, dk, generator=gen) * 0.1
    slots = torch.tensor([3, 0, 4])
    ref_states = states.clone()
    ref = gdn.delta_rule_decode(q[:3], k[:3], v[:3], g[:3], beta[:3], ref_states, slots)
    got_states = states.cuda()
    got = gdn.fla_decode(fused, *(x.cuda() for x in (q[:3], k[:3], v[:3], g[:3], beta[:3])),
                         got_states, slots.cuda())
    torch.testing.assert_close(got.cpu(), ref, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got_states.cpu(), ref_states, atol=2e-2, rtol=2e-2)
