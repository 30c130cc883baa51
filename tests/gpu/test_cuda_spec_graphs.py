"""Speculative decoding inside the decode CUDA graphs: a verify step of T tokens (1 + k
a verifying row) replays the decode graph of the smallest size >= T, and the drafter
reads the taps the graph wrote. Greedy tokens on CUDA (fp32, graphs) equal the CPU's
without speculation; verify steps replayed (a hybrid's run eagerly). Skipped without
CUDA (scripts/gpu_check.sh runs them on a GPU); tests/models/test_triton_path.py
proves the same plumbing on the CPU with the graphs stood in for."""
from __future__ import annotations

import json
import os

import pytest
import torch

from conftest import TINY, build_checkpoint, make_llm, make_prompts, runner_of, scheduler_of
from tokenmill import SamplingParams
from tokenmill.spec_decode import random_drafters as rd
from test_cuda_parity import GPU_SPECS, ieee_fp32  # noqa: F401 (IEEE fp32 matmuls: autouse)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CASES = [("llama_gqa_tied", "ngram"), ("llama_gqa_tied", "eagle3"),
         ("llama_gqa_tied", "dflash"), ("gemma3", "ngram"), ("qwen3_moe", "ngram"),
         ("qwen3_5", "ngram")]
K = 3
NUM_NEW = 16


def _prompts(vocab: int) -> list[list[int]]:
    """Prompts that repeat a motif (n-gram drafts find it) and one that does not."""
    motifs = make_prompts([3, 4, 2], vocab, seed=31)
    heads = make_prompts([5, 2, 7, 9], vocab, seed=32)
    return [heads[0] + motifs[0] * 4, heads[1] + motifs[1] * 3, heads[2] + motifs[2] * 5,
            heads[3]]


def _spec(name, method, path, tmp_path) -> dict:
    spec = {"method": method, "num_speculative_tokens": K}
    if method == "ngram":
        return dict(spec, prompt_lookup_min=1, prompt_lookup_max=3)
    config = json.load(open(os.path.join(path, "config.json")))
    config = {**config, **config.get("text_config", {})}
    draft = str(tmp_path / method)
    os.makedirs(draft)
    if method == "eagle3":
        rd.build_eagle3_checkpoint(draft, config)
    else:
        rd.build_dflash_checkpoint(draft, config, target_layer_ids=(0, 1), block_size=K + 1)
    return dict(spec, model=draft, adaptive=False)


def _greedy(llm, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.mark.parametrize("name,method", CASES)
def test_cuda_speculation_from_decode_graphs_equals_cpu(tmp_path, name, method):
    arch, overrides = GPU_SPECS[name]
    path = str(tmp_path / name)
    with torch.device("cpu"):
        build_checkpoint(path, arch, overrides)
    prompts = _prompts(TINY["vocab_size"])
    want = _greedy(make_llm(path, device="cpu", cpu_kernels="torch", max_num_seqs=8), prompts)
    llm = make_llm(path, device="cuda", max_num_seqs=8,
                   speculative_config=_spec(name, method, path, tmp_path))
    runner = runner_of(llm)
    graphs = runner.cuda_graphs
    assert graphs is not None and graphs.sizes[-1] >= 8 * (1 + K)
    replays = {"decode": 0, "verify": 0}
    real_run = graphs.run

    def run(ids, pos, meta):
        replays["verify" if runner.last_step.cu_num_logits is not None else "decode"] += 1
        return real_run(ids, pos, meta)
    graphs.run = run
    got = _greedy(llm, prompts)
    assert scheduler_of(llm).spec_stats.num_drafts > 0
    assert got == want
    if name == "qwen3_5":  # recurrent layers verify in order, eagerly
        assert replays["verify"] == 0 and replays["decode"] > 0
    else:
        assert replays["verify"] > 0
    if method != "ngram":
        assert graphs.taps  # the drafter's taps are graph outputs
