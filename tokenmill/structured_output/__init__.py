"""Structured output: grammar-constrained decoding through token bitmasks (xgrammar).

`params` (StructuredOutputsParams) is light and imported by SamplingParams;
`manager` (per-engine grammars, compiled off the step, per-request matchers,
the step's compact bitmask) and `backend` (xgrammar) load on first use. The
runner side, unpacking the bitmask onto the logits, is tokenmill.sample.bitmask.
"""
from tokenmill.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
