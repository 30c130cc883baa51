"""KV cache memory: allocated from the specs, viewed per layer.

Every layer gets `num_blocks * spec.page_size_bytes` raw bytes. Its view is
[num_blocks, 2, block_size, num_kv_heads, head_size] over the first
`real_page_size_bytes` of each page, so a padded page keeps its padding.
"""
from __future__ import annotations

import os

import torch

from tokenmill.core.kv_cache_spec import FullAttentionSpec, KVCacheConfig

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def allocate_kv_caches(config: KVCacheConfig, device: torch.device) -> dict[str, torch.Tensor]:
    caches = {}
    for group in config.groups:
        if not group.is_attention:
            continue
        spec = group.spec
        for name in group.layer_names:
            caches[name] = _allocate_layer(spec, config.num_blocks, device)
    return caches


def _allocate_layer(spec: FullAttentionSpec, num_blocks: int, device) -> torch.Tensor:
    raw = torch.zeros(num_blocks, spec.page_size_bytes, dtype=torch.uint8, device=device)
    dtype = TORCH_DTYPES[spec.dtype]
    pages = raw[:, :spec.real_page_size_bytes].view(dtype)
    return pages.view(num_blocks, 2, spec.block_size, spec.num_kv_heads, spec.head_size)


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
