"""CUDA-graph padding logic (tokenmill/worker/cuda_graph.py), without a GPU: the
capture sizes, the size a batch pads to, and the static buffers a step fills (its
rows copied, the pad rows inert). The end-to-end check, graphs replayed eagerly on
CPU over the static buffers, is in tests/models/test_triton_path.py."""
import pytest
import torch

from tokenmill.attention.metadata import AttentionMetadata
from tokenmill.worker.cuda_graph import DecodeGraphBuffers, capture_sizes, padded_size


def test_capture_sizes_follow_vllm_and_cover_max_num_seqs():
    assert capture_sizes(256) == [1, 2, 4] + list(range(8, 257, 8))
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(1) == [1]
    assert capture_sizes(300)[-3:] == [272, 288, 304]
    assert capture_sizes(10_000)[-1] == 512
    assert capture_sizes(64, limit=16) == [1, 2, 4, 8, 16]
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


def test_padded_size_is_the_smallest_size_that_fits():
    sizes = capture_sizes(64)
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 8, 9, 17, 64)] == \
        [1, 2, 4, 4, 8, 8, 16, 24, 64]
    assert padded_size(65, sizes) is None  # above the largest graph: eager


def _meta(n, width, seed):
    g = torch.Generator().manual_seed(seed)
    return AttentionMetadata(
        num_decodes=n, slot_block=torch.zeros(n, dtype=torch.long),
        slot_offset=torch.zeros(n, dtype=torch.long),
        decode_block_table=torch.randint(1, 50, (n, width), generator=g, dtype=torch.int32),
        decode_seq_lens=torch.randint(1, 40, (n,), generator=g, dtype=torch.int32),
        slot_mapping=torch.randint(16, 800, (n,), generator=g))


def test_fill_copies_rows_and_makes_pad_rows_inert():
    buf = DecodeGraphBuffers(8, {0: 6}, "cpu")
    big = _meta(7, 5, seed=0)
    buf.fill(8, torch.arange(1, 8), torch.arange(10, 17), big)
    small = _meta(3, 2, seed=1)  # a later, smaller step over the same buffers
    buf.fill(4, torch.tensor([5, 6, 7]), torch.tensor([20, 21, 22]), small)
    g = buf.groups[0]
    assert buf.input_ids[:4].tolist() == [5, 6, 7, 0]
    assert buf.positions[:4].tolist() == [20, 21, 22, 0]
    assert torch.equal(g.slot_mapping[:3], small.slot_mapping)
    assert g.slot_mapping[3] == -1  # the pad row writes no K/V
    assert torch.equal(g.block_table[:3, :2], small.decode_block_table)
    assert torch.equal(g.block_table[3], torch.zeros(6, dtype=torch.int32))  # null block
    assert torch.equal(g.seq_lens[:3], small.decode_seq_lens)
    assert g.seq_lens[3] == 0  # reads nothing
    meta = buf.metadata(4)
    assert meta.decode_block_table.shape == (4, 6) and meta.slot_mapping.shape == (4,)
    assert meta.decode_seq_lens.data_ptr() == g.seq_lens.data_ptr()  # static: the graph's


def test_fill_every_group_of_a_multi_group_model():
    buf = DecodeGraphBuffers(4, {0: 3, 1: 5}, "cpu")
    m0, m1 = _meta(2, 3, seed=2), _meta(2, 4, seed=3)
    m0.by_group = {0: m0, 1: m1}
    buf.fill(2, torch.tensor([1, 2]), torch.tensor([3, 4]), m0)
    assert torch.equal(buf.groups[1].slot_mapping[:2], m1.slot_mapping)
    assert torch.equal(buf.groups[1].block_table[:2, :4], m1.decode_block_table)
    meta = buf.metadata(2)
    assert set(meta.by_group) == {0, 1}
    assert meta.for_group(1).decode_block_table.shape == (2, 5)


def test_fill_refuses_a_step_larger_than_its_graph():
    buf = DecodeGraphBuffers(4, {0: 2}, "cpu")
    with pytest.raises(ValueError, match="cannot be padded"):
        buf.fill(2, torch.arange(3), torch.arange(3), _meta(3, 2, seed=0))


def test_pad_rows_of_a_hybrid_model_use_the_scratch_state_slot():
    from tokenmill.attention.metadata import StateMetadata
    buf = DecodeGraphBuffers(8, {0: 2}, "cpu", pad_state_slot=12)
    meta = _meta(3, 2, seed=4)
    meta.state = StateMetadata(3, torch.tensor([4, 0, 7]))
    buf.fill(4, torch.arange(3), torch.arange(3), meta)
    assert buf.state_indices[:4].tolist() == [4, 0, 7, 12]
    static = buf.metadata(4)
    assert static.state.num_decodes == 4 and not static.state.prefills
    assert static.state.state_indices.data_ptr() == buf.state_indices.data_ptr()
    buf.make_inert(8)
    assert buf.state_indices.tolist() == [12] * 8
    assert DecodeGraphBuffers(2, {0: 1}, "cpu").metadata(2).state is None
