"""pytest fixtures that run a kernel test once per capability level (tokenmill.kernels).

    from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)

`kernel_level` is parametrized over every level of this architecture: a level this
CPU cannot execute is skipped with its name; the others run with the engine's
chosen level forced to them (capability_override), so code that calls `cpu_ops()`
(layers, the model runner) runs that level's kernels too. `ops` is that level's
module, or a skip when there is no compiler (TOKENMILL_NO_NATIVE=1).
"""
from __future__ import annotations

import pytest

from tokenmill import kernels


@pytest.fixture(params=kernels.all_levels())
def kernel_level(request):
    level = request.param
    if level not in kernels.runnable_levels():
        pytest.skip(f"this CPU cannot run the {level} kernels "
                    f"(it runs {', '.join(kernels.runnable_levels())})")
    with kernels.capability_override(level):
        yield level


@pytest.fixture
def ops(kernel_level):
    module = kernels.cpu_ops(kernel_level)
    if module is None:
        pytest.skip("no native CPU kernels (no compiler, or TOKENMILL_NO_NATIVE=1)")
    assert module.capability == kernel_level
    return module
