"""tokenmill: a readable LLM inference engine in the vLLM V1 mold.

Names are imported lazily, so `import tokenmill.core` stays free of torch.
"""
import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "tokenmill.llm",
    "SamplingParams": "tokenmill.sampling_params",
    "StructuredOutputsParams": "tokenmill.structured_output.params",
    "EngineArgs": "tokenmill.engine.llm_engine",
    "RequestOutput": "tokenmill.outputs",
    "CompletionOutput": "tokenmill.outputs",
    "PoolingParams": "tokenmill.pooling.params",
    "EmbeddingRequestOutput": "tokenmill.outputs",
}
__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tokenmill' has no attribute {name!r}")
