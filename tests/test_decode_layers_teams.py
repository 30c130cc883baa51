"""The native decode loops run on one team of threads (kernels/parallel.h): one OpenMP
region per call, whose threads take the chunks of every layer's parallel loops (the
linears, attention, Gemma's GELU) instead of each loop forking its own region.

The team must give the bits a region per loop gives (the same chunks, each run whole by
one thread) and the bits of the Python layers; at more threads than this machine has
cores too (the waits' spin-then-yield), and an error inside the loop must reach the
caller with no thread left waiting. The suite runs on one thread (conftest), where no
team opens: these tests set their own counts."""
from __future__ import annotations

import pytest
import torch

from conftest import build_checkpoint, make_llm, runner_of
from test_decode_layers import _spy, _spy_gemma, _spy_gemma4, widened  # noqa: F401
from tokenmill import SamplingParams
from tokenmill.kernels.testing import kernel_level, ops  # noqa: F401 (fixtures)

# Wide enough that the quantized linears split too (their grain inside a team is 32K
# weights x rows: 4 column blocks at K = 256) and every linear has several blocks.
WIDE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_hidden_layers=2, vocab_size=384)


@pytest.fixture(params=[1, 2, 3], ids=lambda n: f"{n}threads")
def threads(request):
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)


@pytest.fixture(scope="module")
def wide_checkpoints(tmp_path_factory):
    """The wide Qwen3 as saved (bf16 / fp32 runs) and as GPTQ int4 (g32, act-order) and
    int8 checkpoints written from it."""
    from tokenmill.models import quant_formats
    src = str(tmp_path_factory.mktemp("wide_qwen3"))
    build_checkpoint(src, "qwen3", WIDE)
    paths = {"float": src}
    for name, kw in (("gptq_int4", dict(bits=4, group_size=32, sym=False, desc_act=True)),
                     ("gptq_int8", dict(bits=8, group_size=-1, sym=True))):
        paths[name] = str(tmp_path_factory.mktemp(name))
        quant_formats.write_gptq_checkpoint(src, paths[name], return_dequantized=False, **kw)
    return paths


def _prompts(n: int = 6):
    """Staggered requests: decode steps of min(n, max_num_seqs) rows down to 1."""
    g = torch.Generator().manual_seed(3)
    lens = [5, 17, 33, 8, 40, 12] * (n // 6 + 1)
    prompts = [{"prompt_token_ids": torch.randint(1, 384, (k,), generator=g).tolist()}
               for k in lens[:n]]
    params = [SamplingParams(max_tokens=5 + 3 * i, temperature=0.0, ignore_eos=True)
              for i in range(n)]
    return prompts, params


def _tokens_both_ways(llm, ops, rows: list, n: int = 6):
    """Token ids with teams (the default), then with a region per loop, required equal;
    returns the loops handed to teams and the native calls (the spy's `rows`) of the
    first run."""
    prompts, params = _prompts(n)
    before = ops.team_loops()
    with_teams = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                               use_tqdm=False)]
    handed, calls = ops.team_loops() - before, len(rows)
    assert ops.set_teams(False) is True
    try:
        without = [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                use_tqdm=False)]
    finally:
        ops.set_teams(True)
    assert with_teams == without
    return handed, calls


@pytest.mark.parametrize("case", ["bfloat16", "float32", "gptq_int4", "gptq_int8"])
def test_team_loop_is_bit_identical(wide_checkpoints, monkeypatch, widened, ops, threads,
                                    case):
    """Every native call is compared with the Python layers on the same input (the spy),
    and the tokens with teams off; at two and three threads the loops went to teams."""
    if case.startswith("gptq") and not hasattr(ops, "linear_quant"):
        pytest.skip("this level has no quantized kernel")
    path = wide_checkpoints["float" if case in ("bfloat16", "float32") else case]
    rows = _spy(monkeypatch, compare=True)
    llm = make_llm(path, dtype="float32" if case == "float32" else "bfloat16", max_num_seqs=4)
    native = runner_of(llm).model.decode_layers is not None
    handed, calls = _tokens_both_ways(llm, ops, rows)
    if not native:
        assert rows == [] and handed == 0
        return
    assert max(rows) == 4 and min(rows) == 1
    # one thread: no team opens; more: five loops a layer (qkv, attention, o_proj,
    # gate_up, down), two layers, every call
    assert handed == (10 * calls if threads > 1 else 0)


def test_steps_past_the_team_rows_fork_per_loop(wide_checkpoints, monkeypatch, widened, ops):
    """Decode steps of more than kTeamMaxRows (8) rows open no team: some of their
    kernels (the vdpbf16ps many-row linears) run at::parallel_for themselves, which
    inside a team's region would run on one thread (1.4x slower at 16-64 rows). Up to 8
    rows, ten loops a call go to the team, as above; the same bits either way."""
    rows = _spy(monkeypatch, compare=True)
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # (no prefix caching: both runs must schedule the same steps, as past 8 rows a
        # step's row count changes the bf16 GEMMs' rounding)
        llm = make_llm(wide_checkpoints["float"], dtype="bfloat16", max_num_seqs=12,
                       enable_prefix_caching=False)
        if runner_of(llm).model.decode_layers is None:
            pytest.skip(f"no native decode loop at the {ops.capability} level")
        handed, calls = _tokens_both_ways(llm, ops, rows, n=12)
    finally:
        torch.set_num_threads(old)
    small = sum(1 for r in rows[:calls] if r <= 8)
    assert max(rows[:calls]) == 12 and 0 < small < calls
    assert handed == 10 * small


@pytest.mark.parametrize("model", ["gemma3", "gemma4"])
def test_gemma_team_loops_are_bit_identical(tiny_model_factory, monkeypatch, widened, ops,
                                            threads, model):
    rows = (_spy_gemma if model == "gemma3" else _spy_gemma4)(monkeypatch, compare=True)
    llm = make_llm(tiny_model_factory(model).path, dtype="bfloat16", max_num_seqs=4)
    native = runner_of(llm).model.decode_layers is not None
    assert native == ops.has_fast_linear_bf16
    handed, calls = _tokens_both_ways(llm, ops, rows)
    assert bool(rows) == native
    assert (handed > calls) if native and threads > 1 else handed == 0


class _Recorder:
    """The kernels module, recording each decode_layers call's input, output and args."""

    def __init__(self, ops):
        self._ops = ops
        self.calls = []

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def decode_layers(self, x, *args, **kw):
        x0 = x.clone()
        out = self._ops.decode_layers(x, *args, **kw)
        self.calls.append((x0, out.clone(), args, kw))
        return out


def test_an_error_inside_the_team_leaves_no_thread_waiting(wide_checkpoints, widened, ops):
    """Layer 1's o_proj given a one-block weight: the kernel's check raises inside the
    team's body after layer 0's loops ran on it; the error reaches the caller, and the
    next call (the real weights) gives the recorded output again."""
    llm = make_llm(wide_checkpoints["float"], dtype="bfloat16", max_num_seqs=4)
    loop = runner_of(llm).model.decode_layers
    if loop is None:
        pytest.skip("no native decode loop at this level")
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loop.ops = rec = _Recorder(ops)
        prompts, params = _prompts()
        llm.generate(prompts[:1], params[:1], use_tqdm=False)
        x0, out, args, kw = rec.calls[-1]
        weights = list(args[0])
        per_layer = len(weights) // loop.num_layers
        o_proj_1 = per_layer + 9  # cpu_decode_layers.cpp: Slot O_PROJ, LinearSlot W
        bad = list(weights)
        bad[o_proj_1] = weights[o_proj_1][:1].clone()
        before = ops.team_loops()
        with pytest.raises(RuntimeError, match="column count"):
            ops.decode_layers(x0.clone(), bad, *args[1:], **kw)
        assert ops.team_loops() > before  # layer 0 ran on the team
        for _ in range(3):
            assert torch.equal(ops.decode_layers(x0.clone(), weights, *args[1:], **kw), out)
    finally:
        torch.set_num_threads(old)
