"""Attention backends (tokenmill/attention/): which one the platform picks per KV cache
spec, that each one's builder + implementation gives the PyTorch reference's output and
cache on the same paged step, and that nothing outside the backends and the platform
chooses attention kernels.

The Triton backend runs under Triton's interpreter (TRITON_INTERPRET=1 before triton
is imported) on CPU tensors where triton imports; the CPU native one where the native
kernels build. The CUDA platform's choice is made without a GPU: it reads only what
imports (`tokenmill.platforms.cuda.module_available`).
"""
from __future__ import annotations

import ast
import os
import re
from dataclasses import fields
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

import tokenmill  # noqa: E402
from tokenmill import kernels  # noqa: E402
from tokenmill.attention.cpu_native import CpuNativeAttentionBackend  # noqa: E402
from tokenmill.attention.metadata import AttentionMetadata  # noqa: E402
from tokenmill.attention.mla import CpuNativeMLABackend, TorchMLABackend  # noqa: E402
from tokenmill.attention.torch_ref import TorchAttentionBackend  # noqa: E402
from tokenmill.attention.triton import TritonAttentionBackend  # noqa: E402
from tokenmill.core.kv_cache_spec import (FullAttentionSpec, MLAAttentionSpec,  # noqa: E402
                                          SlidingWindowSpec)
from tokenmill.models.layers.attention import PagedAttention  # noqa: E402
from tokenmill.models.layers.mla import PagedMLAAttention  # noqa: E402
from tokenmill.platforms import cuda as cuda_platform  # noqa: E402
from tokenmill.platforms.cpu import CpuPlatform  # noqa: E402
from tokenmill.platforms.cuda import CudaPlatform  # noqa: E402
from tokenmill.worker.block_table import BlockTable  # noqa: E402

CPU = torch.device("cpu")
FULL = FullAttentionSpec(4, 2, 64, "float32")
SLIDING = SlidingWindowSpec(4, 2, 64, "float32", 12)
HEAD_512 = FullAttentionSpec(4, 1, 512, "float32")
HEAD_640 = FullAttentionSpec(4, 1, 640, "float32")
MLA = MLAAttentionSpec(4, 32, 8, "float32")


def _native_ops():
    ops = kernels.cpu_ops()
    if ops is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    return ops


def _names(platform, specs):
    return [platform.attention_backend(s).name for s in specs]


# ---- selection ------------------------------------------------------------------------

def test_cpu_native_platform_picks_the_native_kernels():
    ops = _native_ops()
    platform = CpuPlatform.create("cpu", torch.float32)
    assert platform.attention == "native" and platform.ops is ops
    assert _names(platform, [FULL, SLIDING, HEAD_640, MLA]) == [
        "cpu_native", "cpu_native", "cpu_native", "mla_cpu_native"]
    backend = platform.attention_backend(FULL)
    assert backend.ops is ops and backend.make_impl(PagedAttention(4, 2, 64, 0.1)).ops is ops


def test_cpu_torch_platform_picks_the_reference():
    platform = CpuPlatform.create("cpu", torch.float32, cpu_kernels="torch")
    assert platform.attention == "torch"
    assert _names(platform, [FULL, SLIDING, HEAD_640, MLA]) == [
        "torch", "torch", "torch", "mla_torch"]


@pytest.mark.parametrize("triton", [True, False])
def test_cuda_platform_picks_triton_up_to_head_size_512(monkeypatch, triton):
    """Decided without a GPU: from whether triton imports."""
    monkeypatch.setattr(cuda_platform, "module_available",
                        lambda name: triton if name == "triton" else False)
    platform = CudaPlatform.create("cuda", torch.bfloat16)
    assert platform.attention == ("triton" if triton else "torch")
    want = (["triton", "triton", "triton", "torch", "mla_torch"] if triton
            else ["torch"] * 4 + ["mla_torch"])
    assert _names(platform, [FULL, SLIDING, HEAD_512, HEAD_640, MLA]) == want
    # Decode graphs only where every group's decode steps replay (Triton's).
    assert [platform.attention_backend(s).cuda_graphs for s in (FULL, HEAD_640)] == \
        [triton, False]


def test_backends_take_only_their_spec_kinds():
    ops = object()
    for backend in (TorchAttentionBackend(), CpuNativeAttentionBackend(ops),
                    TritonAttentionBackend()):
        assert backend.supports(FULL) and backend.supports(SLIDING)
        assert not backend.supports(MLA)
    for backend in (TorchMLABackend(), CpuNativeMLABackend(ops)):
        assert backend.supports(MLA) and not backend.supports(FULL)
    assert not TritonAttentionBackend().supports(HEAD_640)


def test_runner_binds_each_group_from_the_platform(tiny_model_factory):
    """Gemma 3 (local and global layers: two KV cache groups): each group gets its
    backend and builder, each layer its implementation, once, at initialize_kv_cache."""
    from conftest import make_llm, runner_of
    tm = tiny_model_factory("gemma3")
    for kernels_arg, name in (("torch", "torch"), ("auto", None)):
        llm = make_llm(tm.path, cpu_kernels=kernels_arg, max_num_seqs=2)
        runner = runner_of(llm)
        platform = llm.llm_engine.platform
        name = name or ("cpu_native" if platform.ops is not None else "torch")
        assert len(runner.attn_group_ids) == 2
        assert set(runner.attn_backends) == set(runner.attn_builders) == \
            set(runner.attn_group_ids)
        assert {b.name for b in runner.attn_backends.values()} == {name}
        impl_class = next(iter(runner.attn_backends.values())).impl_class
        assert all(type(layer.impl) is impl_class
                   for layer in runner.attention_layers().values())


# ---- every backend against the reference on one paged step ----------------------------

BS, HQ, HKV, D = 4, 4, 2, 16
# Two decode rows (8 and 13 cached tokens), a chunk of 5 after 6 cached tokens, a fresh
# prompt of 4: decode-first, as the runner orders a step.
COMPUTED = np.array([8, 13, 6, 0])
NUM_SCHED = np.array([1, 1, 5, 4])


def _step():
    """The flat step inputs and a block table of scattered ids (0 is the null block)."""
    n = COMPUTED.size
    seq_lens = COMPUTED + NUM_SCHED
    qsl = np.zeros(n + 1, dtype=np.int64)
    qsl[1:] = np.cumsum(NUM_SCHED)
    req = np.repeat(np.arange(n), NUM_SCHED)
    positions = COMPUTED[req] + np.arange(int(qsl[-1])) - np.repeat(qsl[:-1], NUM_SCHED)
    table = BlockTable(n, 8, BS)
    ids = np.random.default_rng(0).permutation(np.arange(1, 40))
    used = 0
    for r, length in enumerate(seq_lens):
        nb = -(-int(length) // BS)
        table.add_row(ids[used:used + nb].tolist(), r)
        used += nb
    return table, req, positions, seq_lens, qsl


def _run(backend, layer, cache, q, k, v, window):
    """One step through `backend`: metadata from its builder, K/V written, attention."""
    table, req, positions, seq_lens, qsl = _step()
    meta = backend.make_builder(CPU).step(table, window, req, positions, seq_lens, COMPUTED,
                                          NUM_SCHED, qsl, 2, COMPUTED.size)
    layer.kv_cache = cache
    layer.impl = backend.make_impl(layer)
    return layer(q, k, v, meta), cache


def _paged_backends():
    out = [pytest.param("cpu_native", id="cpu_native")]
    try:
        import triton  # noqa: F401
        out.append(pytest.param("triton", id="triton"))
    except ImportError:
        out.append(pytest.param("triton", id="triton", marks=pytest.mark.skip("no triton")))
    return out


@pytest.mark.parametrize("name", _paged_backends())
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 2.0), (5, 2.0)])
def test_paged_backend_matches_the_reference(name, window, softcap):
    """Decode rows, a prompt chunk over its cached prefix, a fresh prompt; with a sliding
    window (the builder's null blocks before it) and soft-capped scores: same output
    and same cache as the PyTorch reference, in fp32."""
    backend = (CpuNativeAttentionBackend(_native_ops()) if name == "cpu_native"
               else TritonAttentionBackend())
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(40, 2, BS, HKV, D, generator=g)
    t = int(NUM_SCHED.sum())
    q = torch.randn(t, HQ, D, generator=g) * 3  # scores large enough for the cap to bite
    k, v = torch.randn(t, HKV, D, generator=g), torch.randn(t, HKV, D, generator=g)
    layer = PagedAttention(HQ, HKV, D, D ** -0.5, sliding_window=window,
                           logit_softcap=softcap)
    ref, ref_cache = _run(TorchAttentionBackend(), layer, cache.clone(), q, k, v, window)
    got, got_cache = _run(backend, layer, cache.clone(), q, k, v, window)
    assert type(layer.impl) is backend.impl_class
    torch.testing.assert_close(got_cache, ref_cache, atol=0, rtol=0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    if softcap is not None:  # the cap moved the output: the comparison sees it
        uncapped = PagedAttention(HQ, HKV, D, D ** -0.5, sliding_window=window)
        plain, _ = _run(TorchAttentionBackend(), uncapped, cache.clone(), q, k, v, window)
        assert (plain - ref).abs().max() > 1e-3


def test_triton_builder_adds_only_its_flat_fields():
    """The base builder's fields are the same; Triton's adds the flat slot mapping and
    the prompt chunks at once, which no other backend's metadata carries."""
    table, req, positions, seq_lens, qsl = _step()
    args = (table, None, req, positions, seq_lens, COMPUTED, NUM_SCHED, qsl, 2, COMPUTED.size)
    base = TorchAttentionBackend().make_builder(CPU).step(*args)
    flat = TritonAttentionBackend().make_builder(CPU).step(*args)
    for f in ("slot_block", "slot_offset", "decode_block_table", "decode_seq_lens"):
        assert torch.equal(getattr(base, f), getattr(flat, f))
    assert base.slot_mapping is None and base.prefill_query_start_loc is None
    assert torch.equal(flat.slot_mapping, flat.slot_block * BS + flat.slot_offset)
    assert flat.prefill_query_start_loc.tolist() == [0, 5, 9]
    assert flat.prefill_seq_lens.tolist() == [11, 4] and flat.prefill_max_query_len == 5


def test_mla_backends_agree():
    """MLA's absorbed decode through the native latent kernel and the batched matmuls."""
    ops = _native_ops()
    heads, nope, rope, v_dim, r = 4, 16, 8, 12, 32
    g = torch.Generator().manual_seed(2)
    layer = PagedMLAAttention(heads, nope, rope, v_dim, r, scale=0.2)
    kv_b = torch.nn.Linear(r, heads * (nope + v_dim), bias=False)
    torch.nn.init.normal_(kv_b.weight, std=0.3, generator=g)
    cache = torch.randn(20, BS, r + rope, generator=g)
    table = BlockTable(3, 6, BS)
    for row, blocks in enumerate(([3, 9, 4], [7, 1], [12, 5, 6, 2])):
        table.add_row(blocks, row)
    positions = np.array([10, 5, 14])
    q = torch.randn(3, heads, nope + rope, generator=g)
    latent = torch.randn(3, r + rope, generator=g)
    outs = []
    for backend in (TorchMLABackend(), CpuNativeMLABackend(ops)):
        meta = backend.make_builder(CPU).decodes(table, np.arange(3), positions)
        layer.kv_cache = cache.clone()
        layer.impl = backend.make_impl(layer)
        with torch.no_grad():
            outs.append((layer(q, latent, kv_b, meta), layer.kv_cache))
    torch.testing.assert_close(outs[1][1], outs[0][1], atol=0, rtol=0)
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)


# ---- nothing else chooses attention kernels ------------------------------------------

ROOT = Path(tokenmill.__file__).parent
CHOOSERS = ("attention/", "platforms/")
# The Triton kernels themselves, their ahead-of-time compiler and their benchmark.
KERNEL_HOMES = ("ops/", "bench/attention_kernels.py")


def _sources(skip: tuple[str, ...]):
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if not rel.startswith(skip):
            yield rel, path.read_text()


def test_only_the_backends_name_the_triton_kernels():
    bad = [rel for rel, text in _sources(CHOOSERS + KERNEL_HOMES) if "triton_attention" in text]
    assert bad == []


def test_no_kernel_handle_travels_in_the_metadata_or_is_checked():
    handle = re.compile(r"\b(native_ops|triton_ops|triton_kv)\b|\bmeta\.\w*ops\b"
                        r"|\.triton_attention\b")
    bad = [f"{rel}:{i}" for rel, text in _sources(CHOOSERS)
           for i, line in enumerate(text.splitlines(), 1) if handle.search(line)]
    assert bad == []
    assert [f.name for f in fields(AttentionMetadata) if f.name.endswith("ops")] == []


def test_the_platform_is_the_only_chooser():
    """Backends are made in Platform.attention_backend only (tests make their own)."""
    made = re.compile(r"\b\w+(Attention|MLA)Backend\(")
    found = [f"{rel}:{i}" for rel, text in _sources(("attention/",))
             for i, line in enumerate(text.splitlines(), 1)
             if made.search(line) and not line.lstrip().startswith("class ")]
    assert found and all(f.startswith("platforms/interface.py:") for f in found), found


@pytest.mark.parametrize("rel,cls,methods", [
    ("models/layers/attention.py", "PagedAttention", ("forward", "write_kv")),
    ("models/layers/mla.py", "PagedMLAAttention", ("forward", "write_latent", "_decode")),
])
def test_layers_do_not_branch_on_kernels(rel, cls, methods):
    """The layers route to their bound `impl`: no condition of theirs looks at kernels."""
    tree = ast.parse((ROOT / rel).read_text())
    klass = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls)
    bodies = [n for n in klass.body if isinstance(n, ast.FunctionDef) and n.name in methods]
    assert len(bodies) == len(methods)
    for fn in bodies:
        for node in ast.walk(fn):
            if isinstance(node, (ast.If, ast.IfExp)):
                names = {getattr(n, "attr", getattr(n, "id", "")) for n in ast.walk(node.test)}
                assert not any(re.search(r"ops|triton|native|impl", s) for s in names), \
                    (cls, fn.name, ast.unparse(node.test))
