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
