"""The environment variables that steer which kernels run, read here and nowhere else.

A leaf (no torch, no tokenmill import): the kernel builder, the platforms and the
Triton compile check read them through these functions, so one file lists what a
deployment can set (the README's "Environment variables" repeats it):

- TOKENMILL_CPU_CAPABILITY: the CPU kernel level (`default`, `avx2`, `avx512`,
  `avx512_vnni`, `avx512_bf16`, `amx`); an error if this CPU cannot run it. The `--cpu-capability` engine
  argument overrides it for one engine.
- ATEN_CPU_CAPABILITY: PyTorch's own ISA cap; tokenmill's level stays at or below it.
- TOKENMILL_NO_NATIVE=1: no native CPU kernels at all (the PyTorch path), as on a
  machine without a C++ compiler.
- TRITON_INTERPRET=1: Triton's interpreter (kernels run on the CPU, for tests); the
  ahead-of-time compile check refuses to run under it.

Read at call time, not at import: a test that sets one sees it (the kernel module
caches its choice; `tokenmill.kernels._forget_choice` makes it choose again).
"""
from __future__ import annotations

import os

KERNEL_ENV_VARS = ("TOKENMILL_CPU_CAPABILITY", "ATEN_CPU_CAPABILITY", "TOKENMILL_NO_NATIVE",
                   "TRITON_INTERPRET")


def forced_cpu_capability() -> str:
    """TOKENMILL_CPU_CAPABILITY as given (stripped; "" when unset)."""
    return os.environ.get("TOKENMILL_CPU_CAPABILITY", "").strip()


def aten_cpu_capability() -> str:
    """ATEN_CPU_CAPABILITY lower-cased ("" when unset)."""
    return os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()


def no_native_kernels() -> bool:
    return os.environ.get("TOKENMILL_NO_NATIVE") == "1"


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
