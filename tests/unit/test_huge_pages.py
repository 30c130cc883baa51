"""The KV cache's buffers are advised for transparent huge pages (worker/huge_pages.py)."""
import re
import sys

import pytest
import torch

from tokenmill.worker.huge_pages import HUGE_PAGE, advise_huge_pages, zeros_huge_paged

THP = "/sys/kernel/mm/transparent_hugepage/enabled"


def _thp_mode() -> str | None:
    try:
        return re.search(r"\[(\w+)\]", open(THP).read()).group(1)
    except (OSError, AttributeError):
        return None


needs_thp = pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() in (None, "never"),
                               reason="transparent huge pages off or not Linux")


def _smaps_field(addr: int, field: str) -> int:
    """`field` of the mapping that holds addr (/proc/self/smaps)."""
    text = open("/proc/self/smaps").read()
    for block in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", text):
        lo, hi = (int(x, 16) for x in block.split()[0].split("-"))
        if lo <= addr < hi:
            return int(re.search(rf"^{field}:\s+(\d+)", block, re.M).group(1))
    raise AssertionError(f"no mapping holds {addr:#x}")


def _interior(t: torch.Tensor) -> int:
    return -(-t.data_ptr() // HUGE_PAGE) * HUGE_PAGE


@needs_thp
def test_zeros_huge_paged_is_eligible_and_zero():
    t = zeros_huge_paged((16, 1 << 20), torch.uint8, "cpu")
    assert _smaps_field(_interior(t), "THPeligible") == 1
    assert int(t.count_nonzero()) == 0


@needs_thp
def test_plain_allocation_is_not_eligible_in_madvise_mode():
    """The check above can fail: without the advice, madvise mode gives no huge pages
    (in a fresh process: in this one, freed advised memory may be handed out again)."""
    import subprocess
    import textwrap
    if _thp_mode() != "madvise":
        pytest.skip("THP mode is not madvise")
    code = textwrap.dedent('''
        import torch
        from tests.unit.test_huge_pages import _interior, _smaps_field
        t = torch.zeros(16, 1 << 20, dtype=torch.uint8)
        print(_smaps_field(_interior(t), "THPeligible"))
    ''')
    root = __file__.rsplit("/tests/", 1)[0]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True,
                         text=True, check=True).stdout
    assert out.strip() == "0"


@needs_thp
def test_kv_cache_buffers_are_advised():
    from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig, KVCacheGroup
    from tokenmill.worker.kv_cache import allocate_kv_caches
    spec = FullAttentionSpec(block_size=16, num_kv_heads=4, head_size=64, dtype="bfloat16")
    config = KVCacheConfig(num_blocks=1024, groups=[KVCacheGroup(["l0", "l1"], spec)])
    caches = allocate_kv_caches(config, torch.device("cpu"))
    for t in caches.values():
        assert _smaps_field(_interior(t), "THPeligible") == 1


def test_small_or_foreign_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(1000)) is False  # no 2 MiB page inside
