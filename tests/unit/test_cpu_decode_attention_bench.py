"""`python -m tokenmill.bench.attention_kernels --kernel native` (bench/cpu_decode_attention.py):
every case of the sweep timed once, its K/V bytes counted as the kernel reads them
(a window's positions only, MLA's one latent row per token), the ratio to the bound
written; the block tables of successive calls take blocks no recent call read."""
import json

import pytest
import torch

from tokenmill import kernels
from tokenmill.bench import attention_kernels, cpu_decode_attention


def test_pool_hands_out_fresh_blocks_until_it_wraps():
    pool = cpu_decode_attention.Pool(10, (2, 4, 1, 8), torch.bfloat16)
    a, b = pool.table(2, 2), pool.table(2, 2)
    assert set(a.flatten().tolist()).isdisjoint(b.flatten().tolist())
    pool.table(1, 2)
    assert pool.table(2, 2).flatten().tolist() == pool.order[:4].tolist()  # wrapped


def test_pool_is_on_huge_pages_as_the_engine_cache_is(monkeypatch):
    """The pool's memory is advised for huge pages before its first touch, as the
    engine's KV cache is (worker/huge_pages.py): with 4 KiB pages every scattered block
    was a TLB miss the engine does not pay (bf16 d64 g1 at batch 32 x 2,048 tokens, one
    thread, the AVX2 EPYC: 2.82x -> 2.12x its bound). The values are the seeded draw."""
    calls = []
    real = cpu_decode_attention.zeros_huge_paged

    def spy(shape, dtype, device):
        calls.append((tuple(shape), dtype, str(device)))
        return real(shape, dtype, device)

    monkeypatch.setattr(cpu_decode_attention, "zeros_huge_paged", spy)
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn):
        pool = cpu_decode_attention.Pool(6, (2, 4, 1, 8), dtype, seed=5)
        assert calls[-1] == ((6, 2, 4, 1, 8), dtype, "cpu")
        draw = torch.float32 if dtype == torch.float32 else torch.bfloat16
        want = torch.randn(6, 2, 4, 1, 8, generator=torch.Generator().manual_seed(5),
                           dtype=draw).to(dtype)
        assert pool.cache.dtype == dtype
        assert torch.equal(pool.cache.view(torch.uint8), want.view(torch.uint8))


def test_native_sweep_writes_every_case(tmp_path):
    if kernels.cpu_ops() is None:
        pytest.skip("no native CPU kernels")
    out = tmp_path / "native.json"
    attention_kernels.main(["--kernel", "native", "--cache-dtypes", "bfloat16,fp8",
                            "--heads", "64", "--gqa", "1,4", "--num-kv-heads", "2",
                            "--batch", "2", "--contexts", "40", "--window", "16",
                            "--mla-heads", "3", "--mla-rank", "32", "--mla-rope", "16",
                            "--pool-mib", "1", "--target-ms", "0.1", "--rounds", "1",
                            "--threads", "1", "--output-json", str(out)])
    data = json.loads(out.read_text())
    rows = data["rows"]
    decode = [r for r in rows if r["kind"] == "paged_decode"]
    assert [(r["cache_dtype"], r["gqa"]) for r in decode] == [
        ("bfloat16", 1), ("bfloat16", 4), ("fp8", 1), ("fp8", 4)]
    # a window of 16 reads 16 positions of each row's 40: K and V, 2 kv heads
    assert decode[0]["kv_bytes"] == 2 * 16 * 2 * 64 * 2 * 2
    assert decode[2]["kv_bytes"] == 2 * 16 * 2 * 64 * 2 * 1
    mla = [r for r in rows if r["kind"] == "mla_decode"]
    assert len(mla) == 1 and mla[0]["kv_bytes"] == 2 * 40 * 48 * 2  # fp8 has no MLA case
    for r in rows:
        bound = r["kv_bytes"] / (data["bandwidth"]["gbps"] * 1e9)
        assert r["seconds"] > 0 and r["vs_bound"] == pytest.approx(r["seconds"] / bound)
