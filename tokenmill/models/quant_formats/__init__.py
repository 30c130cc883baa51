"""Writers of integer-quantized checkpoints in the formats tokenmill loads as published
(GPTQ, AWQ, compressed-tensors pack-quantized): our own round-to-nearest quantization
(rtn.py) of an unquantized Hugging Face folder, encoded into each format's exact
layout (encode.py, over layers/linear_methods/int_packing.py: the packing the readers
use too), plus the dequantized fp32 twin HF transformers runs as the reference
(writer.py). Used by the tests and by the benchmark to make a quantized bench model."""
from tokenmill.models.quant_formats.writer import (write_awq_checkpoint,
                                                   write_compressed_tensors_checkpoint,
                                                   write_gptq_checkpoint)

__all__ = ["write_gptq_checkpoint", "write_awq_checkpoint",
           "write_compressed_tensors_checkpoint"]
