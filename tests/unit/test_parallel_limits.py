"""What the README says of parallelism and of SamplingParams' limits, each checked.

- Tensor parallelism is CPU only: N > 1 on a CUDA device is refused at start-up.
- Data-parallel replicas get CPU shares (equal contiguous shares; more replicas than
  CPUs: unpinned, one thread each).
- Fields vLLM's SamplingParams has and tokenmill does not (`best_of`, `extra_args`,
  per-request `logits_processors`) are refused by name, as is an unknown engine argument.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tokenmill import SamplingParams
from tokenmill.engine import launchers
from tokenmill.errors import ParamError


def test_tensor_parallel_is_refused_on_cuda(llama_tiny):
    from tokenmill.executor import make_executor
    cfg = SimpleNamespace(device=torch.device("cuda"), hf_config=llama_tiny.hf_config)
    with pytest.raises(ValueError, match=r"tensor_parallel_size > 1 runs on CPU \(gloo\) "
                                         r"only for now, not on cuda"):
        make_executor(cfg, None, {}, tensor_parallel_size=2)


def test_replicas_get_equal_cpu_shares(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6})
    assert launchers.cpu_shares(1) == [(None, None)]  # one replica: torch's default
    assert launchers.cpu_shares(2) == [([0, 1, 2], 3), ([3, 4, 5], 3)]
    assert launchers.cpu_shares(3) == [([0, 1], 2), ([2, 3], 2), ([4, 5], 2)]
    assert launchers.cpu_shares(8) == [(None, 1)] * 8  # more replicas than CPUs


@pytest.mark.parametrize("field, value", [("best_of", 2), ("extra_args", {"a": 1}),
                                          ("logits_processors", [lambda ids, x: x])])
def test_vllm_fields_tokenmill_lacks_are_refused_by_name(field, value):
    with pytest.raises(ParamError, match=rf"unknown field '{field}'") as e:
        SamplingParams(**{field: value})
    assert e.value.param == field


def test_unknown_engine_argument_is_refused(llama_tiny):
    from tokenmill import LLM
    with pytest.raises((TypeError, ValueError), match="logits_processors"):
        LLM(llama_tiny.path, logits_processors=["my.module:Proc"])
