"""KV cache memory: allocated from the specs, viewed per layer.

One raw buffer of `num_blocks` pages per layer position: layer j of every
attention group views buffer j (a block id belongs to one group, so no two
layers ever use the same page; KVCacheConfig.buffer_page_sizes). A layer's view
is its spec's `cache_shape` ([num_blocks, 2, block_size, num_kv_heads, head_size];
an MLA layer's latent rows [num_blocks, block_size, kv_lora_rank + rope_dim]) over
the first `real_page_size_bytes` of each page, so a padded page keeps its padding
and groups of different head sizes share buffers of the largest page.
"""
from __future__ import annotations

import os

import torch

from tokenmill.core.kv_cache_spec import AttentionSpec, KVCacheConfig
from tokenmill.worker.huge_pages import zeros_huge_paged

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
                "float8_e4m3fn": torch.float8_e4m3fn}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def allocate_kv_caches(config: KVCacheConfig, device: torch.device) -> dict[str, torch.Tensor]:
    # (huge pages on CPU: a decode step reads blocks scattered over the whole cache)
    buffers = [zeros_huge_paged((config.num_blocks, page), torch.uint8, device)
               for page in config.buffer_page_sizes()]
    caches = {}
    for group in config.groups:
        if not group.is_attention:
            continue
        for j, name in enumerate(group.layer_names):
            caches[name] = _view_layer(group.spec, buffers[j], config.num_blocks)
    return caches


def _allocate_layer(spec: AttentionSpec, num_blocks: int, device) -> torch.Tensor:
    """One layer's cache over a buffer of its own (a drafter's cache in the tests)."""
    raw = torch.zeros(num_blocks, spec.page_size_bytes, dtype=torch.uint8, device=device)
    return _view_layer(spec, raw, num_blocks)


def _view_layer(spec: AttentionSpec, raw: torch.Tensor, num_blocks: int) -> torch.Tensor:
    dtype = TORCH_DTYPES[spec.dtype]
    pages = raw[:, :spec.real_page_size_bytes].view(dtype)
    return pages.view(spec.cache_shape(num_blocks))


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
