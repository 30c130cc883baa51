"""The Triton paged-attention kernels (tokenmill/ops/triton_attention.py) against a
plain PyTorch reference, on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1
must be set before triton is imported: it decides at decoration time). Tiny shapes:
the interpreter runs each program in Python."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")
ta = pytest.importorskip("tokenmill.ops.triton_attention")


def _cache(num_blocks, block_size, hkv, d, dtype, pad=0, seed=0):
    """A [nb, 2, bs, Hkv, D] view over pages of `pad` extra elements (as a padded spec's)."""
    g = torch.Generator().manual_seed(seed)
    page = 2 * block_size * hkv * d
    raw = torch.randn(num_blocks, page + pad, generator=g).to(dtype)
    return raw[:, :page].view(num_blocks, 2, block_size, hkv, d)


def _table(lens, block_size, num_blocks, seed=1):
    """Distinct random block ids (never 0, the null block) for each row."""
    g = torch.Generator().manual_seed(seed)
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    width = max(-(-n // block_size) for n in lens) + 1  # a spare column: rows are cut wider
    table = torch.zeros(len(lens), width, dtype=torch.int32)
    for r, n in enumerate(lens):
        for j in range(-(-n // block_size)):
            table[r, j] = perm.pop()
    return table


def _ref_attend(q, cache, table_row, qpos, scale, window, softcap=0.0):
    """q [M, Hq, D] at positions qpos [M] over the request's keys 0..max(qpos);
    `softcap`: scores capped (cap * tanh(s / cap)) before the mask, as the CPU path."""
    bs, hkv = cache.shape[2], cache.shape[3]
    n = int(qpos.max()) + 1
    pos = torch.arange(n)
    blocks = table_row[pos // bs].long()
    k = cache[blocks, 0, pos % bs].float()  # [n, Hkv, D]
    v = cache[blocks, 1, pos % bs].float()
    rep = q.shape[1] // hkv
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("mhd,nhd->hmn", q.float(), k) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    visible = pos[None, :] <= qpos[:, None]
    if window:
        visible &= pos[None, :] > qpos[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hmn,nhd->mhd", scores.softmax(-1), v)


def test_interpreter_runs_a_trivial_kernel():
    import triton.language as tl

    @triton.jit
    def add_one(x, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(x + i, tl.load(x + i, mask=i < n) + 1, mask=i < n)

    x = torch.arange(5, dtype=torch.float32)
    add_one[(1,)](x, 5, B=8)
    assert x.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0]


@pytest.mark.parametrize("dtype,d", [(torch.float32, 16), (torch.bfloat16, 16),
                                     (torch.float32, 96), (torch.bfloat16, 80),
                                     (torch.float32, 12)])
def test_write_kv_through_slot_mapping_skips_pad_slots(dtype, d):
    """Head sizes that are not powers of two write their D elements only: the masked
    tail of the 128 (or 16) block would land on the next KV head."""
    bs, hkv = 4, 2
    page = 2 * bs * hkv * d
    raw = torch.randn(6, page + 8, generator=torch.Generator().manual_seed(0)).to(dtype)
    raw_before = raw.clone()
    cache = raw[:, :page].view(6, 2, bs, hkv, d)  # a padded page, as a padded spec's
    before = cache.clone()
    g = torch.Generator().manual_seed(3)
    k = torch.randn(5, hkv, d, generator=g).to(dtype)
    v = torch.randn(5, hkv, d, generator=g).to(dtype)
    slots = torch.tensor([9, 10, -1, 21, 4], dtype=torch.int64)  # -1: a pad row
    ta.write_kv(k, v, cache, slots)
    expect = before.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            expect[s // bs, 0, s % bs] = k[t]
            expect[s // bs, 1, s % bs] = v[t]
    assert torch.equal(cache, expect)
    assert torch.equal(raw[:, page:], raw_before[:, page:])  # the padding untouched


@pytest.mark.parametrize("hq,hkv,d,window,softcap", [
    (4, 2, 16, 0, 0.0),    # GQA
    (4, 4, 32, 0, 0.0),    # MHA
    (6, 2, 8, 0, 0.0),     # group of 3 (padded), head_dim below tl.dot's 16
    (4, 1, 16, 5, 0.0),    # MQA, sliding window
    (4, 2, 96, 0, 0.0),    # Phi-3's head size: a 128 block, its tail masked
    (6, 2, 80, 5, 0.0),    # 80 in a 128 block, group of 3, window
    (2, 1, 512, 0, 0.0),   # Gemma 4's global layers
    (6, 2, 12, 0, 0.0),    # 12 in a 16 block (tl.dot's minimum)
    (4, 2, 16, 0, 2.0),    # soft-capped (a cap the scores reach: tanh saturates)
    (4, 2, 96, 5, 3.0),    # soft-capped, masked tail, window
])
def test_paged_decode_matches_reference(hq, hkv, d, window, softcap):
    bs, nb = 4, 24
    cache = _cache(nb, bs, hkv, d, torch.float32)
    lens = [1, 7, 13, 0]  # the last: a pad row of a CUDA graph (null block, length 0)
    table = _table(lens, bs, nb)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(5))
    scale = d ** -0.5 * (4 if softcap else 1)  # scores well past the cap
    out = ta.paged_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), scale,
                          window, softcap=softcap)
    for r, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[r], torch.zeros_like(out[r]))
            continue
        ref = _ref_attend(q[r:r + 1], cache, table[r], torch.tensor([n - 1]), scale, window,
                          softcap)
        torch.testing.assert_close(out[r], ref[0], atol=2e-5, rtol=1e-5)
    if softcap:  # the cap changes the answer (the test would see a kernel ignoring it)
        ref = _ref_attend(q[2:3], cache, table[2], torch.tensor([12]), scale, window)
        assert (out[2] - ref[0]).abs().max() > 1e-3


def test_paged_decode_window_never_reads_blocks_before_it():
    """Blocks before the window may be back in the pool: poison them, same output."""
    bs, hkv, d, hq, window = 4, 2, 16, 4, 6
    cache = _cache(16, bs, hkv, d, torch.float32)
    lens = [14]
    table = _table(lens, bs, 16)
    q = torch.randn(1, hq, d, generator=torch.Generator().manual_seed(2))
    sl = torch.tensor(lens, dtype=torch.int32)
    out = ta.paged_decode(q, cache, table, sl, 0.25, window)
    first_needed = (14 - window) // bs
    poisoned = cache.clone()
    for j in range(first_needed):
        poisoned[table[0, j].long()] = float("nan")
    torch.testing.assert_close(ta.paged_decode(q, poisoned, table, sl, 0.25, window), out)


def test_paged_decode_half_close_to_reference():
    """fp16 (the interpreter's tl.dot gets bf16 wrong: numpy has no bf16; bf16 waits for
    tests/gpu)."""
    bs, hkv, d, hq = 8, 2, 32, 4
    cache = _cache(12, bs, hkv, d, torch.float16)
    lens = [5, 19]
    table = _table(lens, bs, 12)
    q = torch.randn(2, hq, d, generator=torch.Generator().manual_seed(1)).half()
    out = ta.paged_decode(q, cache, table, torch.tensor(lens, dtype=torch.int32), d ** -0.5)
    for r, n in enumerate(lens):
        ref = _ref_attend(q[r:r + 1], cache, table[r], torch.tensor([n - 1]), d ** -0.5, 0)
        torch.testing.assert_close(out[r].float(), ref[0], atol=5e-3, rtol=5e-3)


@pytest.mark.parametrize("hq,hkv,d,window,softcap", [
    (4, 2, 16, 0, 0.0), (2, 1, 32, 7, 0.0),
    (4, 2, 96, 0, 0.0), (2, 1, 80, 7, 0.0), (2, 1, 512, 0, 0.0),
    (4, 2, 16, 0, 2.0), (4, 2, 96, 7, 3.0),  # soft-capped
])
def test_paged_prefill_with_cached_prefix_matches_reference(hq, hkv, d, window, softcap):
    """Three chunks in one step: a fresh prompt, one continuing after 9 cached tokens
    (a chunked prefill / prefix hit), one of 20 tokens after 3 (spans several query
    tiles); their K/V were written first, as the layer does."""
    bs, nb = 4, 40
    cache = _cache(nb, bs, hkv, d, torch.float32)
    q_lens, ctx = [5, 3, 20], [0, 9, 3]
    lens = [a + b for a, b in zip(q_lens, ctx)]
    table = _table(lens, bs, nb)
    qsl = torch.tensor([0, 5, 8, 28], dtype=torch.int64)
    q = torch.randn(28, hq, d, generator=torch.Generator().manual_seed(4))
    scale = d ** -0.5 * (4 if softcap else 1)
    out = ta.paged_prefill(q, cache, table, qsl, torch.tensor(lens, dtype=torch.int32),
                           max(q_lens), scale, window, softcap=softcap)
    for r in range(3):
        s, e = int(qsl[r]), int(qsl[r + 1])
        qpos = torch.arange(ctx[r], lens[r])
        ref = _ref_attend(q[s:e], cache, table[r], qpos, scale, window, softcap)
        torch.testing.assert_close(out[s:e], ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("d,softcap", [(16, None), (96, None), (16, 2.0), (80, 3.0)])
def test_prefill_and_decode_agree_with_the_cpu_layer(d, softcap):
    """The CPU path's PagedAttention (PyTorch) on the same cache and metadata; with
    soft-capping its decode and its written-out prefill attention."""
    from tokenmill.attention.metadata import AttentionMetadata, PrefillChunk
    from tokenmill.attention.torch_ref import TorchAttentionBackend
    from tokenmill.models.layers.attention import PagedAttention
    bs, hkv, hq = 4, 2, 4
    scale = d ** -0.5 * (4 if softcap else 1)
    cache = _cache(20, bs, hkv, d, torch.float32)
    layer = PagedAttention(hq, hkv, d, scale, logit_softcap=softcap)
    layer.kv_cache = cache
    layer.impl = TorchAttentionBackend().make_impl(layer)
    table = _table([6, 11], bs, 20)
    g = torch.Generator().manual_seed(7)
    # one decode row at length 6, then a 4-token chunk after 7 cached tokens
    q = torch.randn(5, hq, d, generator=g)
    k = torch.randn(5, hkv, d, generator=g)
    v = torch.randn(5, hkv, d, generator=g)
    pos = torch.tensor([5, 7, 8, 9, 10])
    rows = torch.tensor([0, 1, 1, 1, 1])
    blocks = table[rows, pos // bs].long()
    meta = AttentionMetadata(num_decodes=1, slot_block=blocks, slot_offset=pos % bs,
                             decode_block_table=table[:1], decode_seq_lens=torch.tensor(
                                 [6], dtype=torch.int32),
                             prefills=[PrefillChunk(1, 5, 7, table[1, :3].long())])
    ref = layer(q, k, v, meta).view(5, hq, d)
    cache2 = _cache(20, bs, hkv, d, torch.float32)  # same seed: the same starting cache
    ta.write_kv(k, v, cache2, blocks * bs + pos % bs)
    torch.testing.assert_close(cache2, cache)
    dec = ta.paged_decode(q[:1], cache2, table[:1], torch.tensor([6], dtype=torch.int32),
                          scale, softcap=softcap)
    pre = ta.paged_prefill(q[1:], cache2, table[1:], torch.tensor([0, 4]),
                           torch.tensor([11], dtype=torch.int32), 4, scale, softcap=softcap)
    torch.testing.assert_close(torch.cat([dec, pre]), ref, atol=2e-5, rtol=1e-5)


def test_bad_shapes_are_refused():
    table, lens = torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="head_size must be at most 512"):
        ta.paged_decode(torch.zeros(1, 2, 640), torch.zeros(4, 2, 4, 2, 640), table, lens, 1.0)
    with pytest.raises(ValueError, match="head_size of q"):
        ta.paged_decode(torch.zeros(1, 2, 16), torch.zeros(4, 2, 4, 2, 12), table, lens, 1.0)
    with pytest.raises(ValueError, match="num_heads 3"):
        ta.paged_prefill(torch.zeros(1, 3, 16), torch.zeros(4, 2, 4, 2, 16), table,
                         torch.tensor([0, 1]), lens, 1, 1.0)
    with pytest.raises(ValueError, match="logit_softcap"):
        ta.paged_decode(torch.zeros(1, 2, 16), torch.zeros(4, 2, 4, 2, 16), table, lens, 1.0,
                        softcap=-1.0)
    with pytest.raises(ValueError, match="kv cache must be"):
        ta.write_kv(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16),
                    torch.zeros(4, 2, 4, 2, 16).transpose(3, 4), torch.zeros(1).long())


def test_tanh_follows_torch():
    """The kernels' soft-capping tanh (exp-based: the interpreter has no libdevice)
    against torch.tanh, across the Taylor / exp switch at 1/4 and into saturation."""
    import triton.language as tl

    @triton.jit
    def tanh_kernel(x, y, n, B: tl.constexpr):
        i = tl.program_id(0) * B + tl.arange(0, B)
        tl.store(y + i, ta._tanh(tl.load(x + i, mask=i < n)), mask=i < n)

    x = torch.cat([torch.linspace(-12, 12, 2001), torch.linspace(-0.3, 0.3, 2001),
                   torch.tensor([0.0, 1e-30, -1e-8, 0.25, -0.25, 80.0, -80.0,
                                 float("inf"), float("-inf")])])
    y = torch.empty_like(x)
    tanh_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), B=1024)
    torch.testing.assert_close(y, torch.tanh(x), atol=0, rtol=4e-7)


@pytest.mark.parametrize("head_size,softcap", [(640, None), (24, None), (16, 30.0),
                                               (96, 2.0)])
def test_layers_take_the_kernels_up_to_head_size_512(head_size, softcap):
    """Where the platform picks Triton, any head size up to 512, soft-capped or not, gets
    the Triton backend (its K/V write and attention); a larger head (none of the
    supported models has one) the PyTorch reference. Same output either way."""
    from tokenmill.attention.metadata import AttentionMetadata
    from tokenmill.attention.torch_ref import TorchAttentionBackend
    from tokenmill.attention.triton import TritonAttentionBackend
    from tokenmill.core.kv_cache_spec import FullAttentionSpec
    from tokenmill.models.layers.attention import PagedAttention
    from tokenmill.platforms.cuda import CudaPlatform

    class Spy:
        calls = []

        def __getattr__(self, name):
            fn = getattr(ta, name)

            def wrapped(*a, **k):
                Spy.calls.append(name)
                return fn(*a, **k)
            return wrapped

    platform = CudaPlatform(device="cuda", model_dtype="float32", gemm_dtype="float32",
                            attention="triton")
    backend = platform.attention_backend(FullAttentionSpec(4, 1, head_size, "float32"))
    takes = head_size <= 512
    assert type(backend) is (TritonAttentionBackend if takes else TorchAttentionBackend)
    layer = PagedAttention(2, 1, head_size, head_size ** -0.5 * 4, logit_softcap=softcap)
    layer.kv_cache = torch.zeros(4, 2, 4, 1, head_size)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, head_size, generator=g) for h in (2, 1, 1))
    base = dict(num_decodes=1, slot_block=torch.tensor([1]), slot_offset=torch.tensor([2]),
                decode_block_table=torch.tensor([[1]], dtype=torch.int32),
                decode_seq_lens=torch.tensor([3], dtype=torch.int32))
    layer.impl = TorchAttentionBackend().make_impl(layer)
    ref = layer(q, k, v, AttentionMetadata(**base))
    layer.kv_cache.zero_()
    layer.impl = backend.make_impl(layer)
    if takes:
        layer.impl.ops = Spy()
    got = layer(q, k, v, AttentionMetadata(**base, slot_mapping=torch.tensor([6])))
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-5)
    assert Spy.calls == (["write_kv", "paged_decode"] if takes else [])


@pytest.mark.parametrize("splits,d,softcap", [(2, 16, 0.0), (4, 16, 0.0), (16, 16, 0.0),
                                              (4, 96, 0.0), (4, 80, 2.0), (2, 512, 3.0)])
def test_split_k_decode_matches_the_single_pass(splits, d, softcap):
    """Split-K (what batch 1 takes on a GPU): the keys in `splits` parts, combined; a
    part may be empty (short rows, a pad row, a window). Masked head tails and
    soft-capping through the split kernel and the combine."""
    bs, hkv, hq = 4, 2, 4
    cache = _cache(24, bs, hkv, d, torch.float32)
    lens = [1, 7, 45, 0]
    table = _table(lens, bs, 24)
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(9))
    sl = torch.tensor(lens, dtype=torch.int32)
    for window in (0, 10):
        one = ta.paged_decode(q, cache, table, sl, 0.25, window, num_splits=1,
                              softcap=softcap)
        got = ta.paged_decode(q, cache, table, sl, 0.25, window, num_splits=splits,
                              softcap=softcap)
        torch.testing.assert_close(got, one, atol=2e-6, rtol=1e-5)
        for r, n in enumerate(lens):
            if n:
                ref = _ref_attend(q[r:r + 1], cache, table[r], torch.tensor([n - 1]), 0.25,
                                  window, softcap)
                torch.testing.assert_close(got[r], ref[0], atol=2e-5, rtol=1e-5)
    assert torch.equal(got[3], torch.zeros_like(got[3]))


def test_decode_splits_only_on_cuda():
    assert ta.decode_splits(1, 8, torch.device("cpu")) == 1
    with pytest.raises(ValueError, match="power of two"):
        ta.paged_decode(torch.zeros(1, 2, 16), torch.zeros(4, 2, 4, 1, 16),
                        torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, dtype=torch.int32),
                        1.0, num_splits=3)


def test_kernel_bench_runs_in_the_interpreter(tmp_path):
    """bench/attention_kernels.py (gpu_check.sh times the head sizes with it on a GPU):
    on the CPU it runs each case once in the interpreter, every field written."""
    import json

    from tokenmill.bench import attention_kernels
    out = tmp_path / "k.json"
    attention_kernels.main(["--device", "cpu", "--dtype", "float32", "--heads", "16,24",
                            "--softcap-heads", "24", "--batch", "1", "--context", "9",
                            "--num-heads", "4", "--num-kv-heads", "2", "--iters", "1",
                            "--output-json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["head_size"], r["softcap"]) for r in rows] == [(16, 0.0), (24, 0.0), (24, 50.0)]
    assert rows[1]["kv_bytes"] == 9 * 2 * 24 * 2 * 4 and all(r["seconds"] > 0 for r in rows)
    with pytest.raises(ValueError, match="num_kv_heads 3"):
        attention_kernels.main(["--device", "cpu", "--num-heads", "4", "--num-kv-heads", "3"])
