"""tokenmill: a readable LLM inference engine in the vLLM V1 mold."""
from tokenmill.engine.llm_engine import EngineArgs
from tokenmill.llm import LLM
from tokenmill.outputs import CompletionOutput, RequestOutput
from tokenmill.sampling_params import SamplingParams

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "EngineArgs", "RequestOutput", "CompletionOutput"]
