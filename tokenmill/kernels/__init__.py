"""Native kernels, compiled on first use with torch's C++ extension builder.

When no compiler is at hand (or TOKENMILL_NO_NATIVE=1), `cpu_ops()` returns
None and callers use their plain PyTorch path.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform

logger = logging.getLogger(__name__)

SOURCES = ("bindings.cpp", "cpu_paged_attention.cpp", "cpu_linear.cpp", "cpu_norm.cpp",
           "cpu_fused.cpp", "cpu_greedy_head.cpp", "cpu_decode_layers.cpp")
HEADERS = ("cpu_vec.h", "ops.h")


def _cpu_fingerprint() -> str:
    """Built with -march=native: a build must never be reused on another CPU model."""
    try:
        with open("/proc/cpuinfo") as f:
            info = "".join(line for line in f if line.startswith(("model name", "flags")))
    except OSError:
        info = platform.processor()
    return hashlib.sha1(info.encode()).hexdigest()[:10]


@functools.cache
def cpu_ops():
    if os.environ.get("TOKENMILL_NO_NATIVE") == "1":
        return None
    try:
        from torch.utils.cpp_extension import load
        here = os.path.dirname(__file__)
        sources = [os.path.join(here, f) for f in SOURCES]
        # Keyed on the sources too: two checkouts with different kernels never share
        # (and keep rebuilding) one build folder.
        hashed = sources + [os.path.join(here, f) for f in HEADERS]
        digest = hashlib.sha1(b"".join(open(p, "rb").read() for p in hashed)).hexdigest()[:8]
        return load(name=f"tokenmill_cpu_ops_{_cpu_fingerprint()}_{digest}", sources=sources,
                    extra_cflags=["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"], verbose=False)
    except Exception as e:  # no compiler, no ninja, unsupported flags...
        logger.warning("native CPU kernels unavailable, using the PyTorch path: %s", e)
        return None
