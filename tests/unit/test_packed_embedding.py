"""A tied embedding read from the lm_head's packed bf16 copy (PackedRowsEmbedding)."""
import pytest
import torch
from torch import nn

from tokenmill.kernels import cpu_ops
from tokenmill.models.layers.linear import Linear
from tokenmill.models.layers.linear_methods import ALL_ROWS, PackedBf16LinearMethod
from tokenmill.models.layers.linear_methods.cpu_packed import (PackedRowsEmbedding,
                                                               tie_embeddings_to_packed_heads)


class Tied(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden, dtype=torch.bfloat16)
        self.lm_head = Linear(hidden, vocab, bias=False, dtype=torch.bfloat16)
        self.lm_head.weight = self.embed_tokens.weight


def _tied(vocab: int, hidden: int, seed: int = 0) -> tuple[Tied, torch.Tensor]:
    torch.manual_seed(seed)
    m = Tied(vocab, hidden)
    with torch.no_grad():
        m.embed_tokens.weight.copy_(torch.randn(vocab, hidden))
    return m, m.embed_tokens.weight.detach().clone()


@pytest.mark.parametrize("vocab,hidden", [(1000, 64), (1027, 96), (32, 8), (33, 130)])
def test_rows_equal_the_embedding(vocab, hidden):
    m, w = _tied(vocab, hidden)
    tied = {id(m.lm_head.weight): m.lm_head}
    m.lm_head.set_method(PackedBf16LinearMethod(cpu_ops(), ALL_ROWS, None))
    assert tie_embeddings_to_packed_heads(m, tied) == 1
    assert isinstance(m.embed_tokens, PackedRowsEmbedding)
    ids = torch.tensor([[0, vocab - 1, 1, 31, 32 % vocab], [vocab // 2, 5 % vocab, 0, 16 % vocab, 17 % vocab]])
    got = m.embed_tokens(ids)
    assert got.shape == (2, 5, hidden) and got.dtype == torch.bfloat16
    assert torch.equal(got, w[ids])
    every = torch.arange(vocab)
    assert torch.equal(m.embed_tokens(every), w)
    # the head still computes x W^T from the same copy
    x = torch.randn(3, hidden, dtype=torch.bfloat16)
    ref = x.float() @ w.float().t()
    assert torch.allclose(m.lm_head(x).float(), ref, atol=1e-2, rtol=1e-2)


def test_out_of_range_ids_raise():
    m, _ = _tied(1000, 64)  # 1000 is not a multiple of 32: ids 1000..1023 are padding
    tied = {id(m.lm_head.weight): m.lm_head}
    m.lm_head.set_method(PackedBf16LinearMethod(cpu_ops(), ALL_ROWS, None))
    tie_embeddings_to_packed_heads(m, tied)
    for bad in (-1, 1000, 1023, 10 ** 6):
        with pytest.raises(IndexError):
            m.embed_tokens(torch.tensor([3, bad]))
    assert m.embed_tokens(torch.zeros(0, dtype=torch.long)).shape == (0, 64)


def test_a_head_with_another_copy_keeps_the_embedding():
    """Only a packed-only head replaces the embedding: with a fallback (which may read the
    shared weight itself) or untied, nothing changes."""
    from tokenmill.models.layers.linear_methods import UnquantizedLinearMethod
    m, _ = _tied(256, 32)
    tied = {id(m.lm_head.weight): m.lm_head}
    m.lm_head.set_method(PackedBf16LinearMethod(cpu_ops(), 8, UnquantizedLinearMethod()))
    assert tie_embeddings_to_packed_heads(m, tied) == 0
    assert type(m.embed_tokens) is nn.Embedding
    m2, _ = _tied(256, 32)
    m2.lm_head.set_method(PackedBf16LinearMethod(cpu_ops(), ALL_ROWS, None))
    assert tie_embeddings_to_packed_heads(m2, {}) == 0


@pytest.mark.parametrize("name", ["qwen2_tied", "gemma3"])
def test_engine_outputs_are_unchanged(tiny_model_factory, monkeypatch, name):
    """A bf16 model with a tied head on the packed-only platform (the default where the
    CPU has AVX512-BF16; forced here elsewhere) looks its tokens up in the head's packed
    copy: tokens and logprobs bit-identical to the engine keeping the embedding, and the
    embedding's bytes are no longer resident."""
    from conftest import make_llm, runner_of

    from tokenmill import SamplingParams
    from tokenmill.models.quantize_at_load import resident_weight_bytes
    from tokenmill.platforms import interface
    tm = tiny_model_factory(name)
    params = SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 13, 2, 7][:n]} for n in (2, 6, 4)]

    def run():
        llm = make_llm(tm.path, dtype="bfloat16", max_num_seqs=3, linear_bf16_max_rows=ALL_ROWS)
        model = runner_of(llm).model
        out = [(o.outputs[0].token_ids, [sorted(d.items()) for d in o.outputs[0].logprobs])
               for o in llm.generate(prompts, params, use_tqdm=False)]
        return model, out, resident_weight_bytes(model)

    model, packed_out, packed_bytes = run()
    if not any(isinstance(m, PackedRowsEmbedding) for m in model.modules()):
        pytest.skip("this platform keeps another copy of the bf16 head")
    monkeypatch.setattr(interface.Platform, "prepare_gemm_layers",
                        _without_tying(interface.Platform.prepare_gemm_layers))
    _, plain_out, plain_bytes = run()
    assert packed_out == plain_out
    cfg = tm.hf_config.get("text_config", tm.hf_config)
    vocab, hidden = cfg["vocab_size"], cfg["hidden_size"]
    assert plain_bytes - packed_bytes == vocab * hidden * 2


def _without_tying(prepare):
    from tokenmill.models.layers.linear_methods import cpu_packed

    def run(self, model):
        real = cpu_packed.tie_embeddings_to_packed_heads
        cpu_packed.tie_embeddings_to_packed_heads = lambda model, tied: 0
        try:
            prepare(self, model)
        finally:
            cpu_packed.tie_embeddings_to_packed_heads = real
    return run
