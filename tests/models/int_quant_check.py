"""Shared by the integer-format parity suites (test_gptq_checkpoint.py,
test_awq_checkpoint.py, test_compressed_tensors_checkpoint.py): a tiny random HF
checkpoint (conftest.build_checkpoint), quantized by tokenmill.models.quant_formats'
writer into the format's layout, with the dequantized fp32 twin written beside it;
the reference is HF transformers on that twin (fp32), run on the same prompts."""
from __future__ import annotations

import json
import os
import warnings

import torch

from conftest import NUM_NEW, build_checkpoint, hf_greedy_batch, make_llm, make_prompts
from logprob_check import K, check_completion
from tokenmill import SamplingParams

GREEDY_LOGPROBS = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True,
                                 logprobs=K)
QWEN3 = ("qwen3", dict(head_dim=32, tie_word_embeddings=False))
LLAMA_TIED = ("llama", dict(tie_word_embeddings=True))


class Quantized:
    """A quantized checkpoint (`path`), its dequantized twin's HF model (`hf`) and the
    prompts; `reference()` HF's greedy tokens, computed once."""

    def __init__(self, path: str, ref_dir: str, deq: dict[str, torch.Tensor]):
        from transformers import AutoModelForCausalLM
        self.path, self.ref_dir, self.deq = path, ref_dir, deq
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.hf = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
        cfg = json.load(open(os.path.join(path, "config.json")))
        vocab = cfg.get("text_config", cfg)["vocab_size"]
        self.vocab_size = vocab
        self.prompts = make_prompts([5, 17, 33, 8], vocab)
        self._refs: dict[tuple, list[list[int]]] = {}

    def reference(self, prompts=None) -> list[list[int]]:
        """HF's NUM_NEW greedy tokens for each of `prompts` (default: self.prompts)."""
        prompts = self.prompts if prompts is None else prompts
        key = tuple(map(tuple, prompts))
        if key not in self._refs:
            self._refs[key] = hf_greedy_batch(self.hf, prompts, NUM_NEW)
        return self._refs[key]


def build_quantized(tmp_path_factory, name: str, spec, write, build=build_checkpoint,
                    **kw) -> Quantized:
    """`spec` (arch, overrides) built (by `build`), then write(src, dst,
    reference_dir=..., **kw)."""
    arch, overrides = spec
    src = str(tmp_path_factory.mktemp(name + "_src"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        build(src, arch, overrides)
    dst = str(tmp_path_factory.mktemp(name))
    ref = str(tmp_path_factory.mktemp(name + "_ref"))
    deq = write(src, dst, reference_dir=ref, **kw)
    assert deq, "the writer quantized nothing"
    return Quantized(dst, ref, deq)


def check_parity(m: Quantized, where: str, prompts=None, llm=None, **llm_kw):
    """The engine (`llm`, or one made with llm_kw) on the quantized checkpoint (fp32)
    against HF on its dequantized twin: greedy tokens equal, logprobs within
    logprob_check's tolerance. Returns the engine."""
    llm = make_llm(m.path, **llm_kw) if llm is None else llm
    prompts = m.prompts if prompts is None else prompts
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_LOGPROBS,
                        use_tqdm=False)
    for i, (p, o, ref) in enumerate(zip(prompts, outs, m.reference(prompts))):
        comp = o.outputs[0]
        assert comp.token_ids == ref, (where, i, comp.token_ids, ref)
        check_completion(m, p, comp, K, f"{where}: prompt {i}", greedy=True)
    return llm
