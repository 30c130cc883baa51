"""Executors: what EngineCore calls to run the model of each step.

With one rank the executor is the ModelRunner itself (tokenmill/worker/model_runner.py):
no layer between the engine and its runner, so nothing is added to a step. With
`tensor_parallel_size` > 1 it is a `MultiprocTPExecutor` (multiproc_tp.py): the same
calls, sent to every rank, the model sharded over them (models/tensor_parallel.py).
"""
from __future__ import annotations

from tokenmill.models.tensor_parallel import check_tensor_parallel_size


def make_executor(model_config, platform, runner_kwargs: dict, tensor_parallel_size: int = 1,
                  model=None, speculative_config=None, draft_model=None):
    """Rank 0's ModelRunner over `model` (one rank), or the executor over
    `tensor_parallel_size` ranks, each loading its own shard (`model` must be None)."""
    check_tensor_parallel_size(tensor_parallel_size)
    if tensor_parallel_size == 1:
        from tokenmill.worker.model_runner import ModelRunner
        return ModelRunner(model, dtype=model_config.dtype, device=model_config.device,
                           platform=platform, speculative_config=speculative_config,
                           draft_model=draft_model, **runner_kwargs)
    if model is not None:
        raise ValueError("tensor_parallel_size > 1: every rank loads its own shard (no "
                         "prebuilt model)")
    from tokenmill.spec_decode.loading import TP_DRAFT_METHODS
    if draft_model is not None:
        raise ValueError("tensor_parallel_size > 1: rank 0 loads the draft model itself "
                         "(no prebuilt draft model)")
    if speculative_config is not None and \
            speculative_config.method not in ("ngram",) + TP_DRAFT_METHODS:
        raise ValueError(f"tensor_parallel_size > 1: speculative decoding with "
                         f"{', '.join(repr(m) for m in ('ngram',) + TP_DRAFT_METHODS)} "
                         f"only, not {speculative_config.method!r}")
    from tokenmill.executor.multiproc_tp import MultiprocTPExecutor
    from tokenmill.models.registry import resolve_model_class
    from tokenmill.models.tensor_parallel import check_divisible
    hf_config = model_config.hf_config  # checked before any rank starts
    check_divisible(hf_config, tensor_parallel_size, resolve_model_class(hf_config))
    if model_config.device.type != "cpu":
        raise ValueError(f"tensor_parallel_size > 1 runs on CPU (gloo) only for now, not on "
                         f"{model_config.device}")
    return MultiprocTPExecutor(model_config, platform, tensor_parallel_size, runner_kwargs,
                               speculative_config=speculative_config)
