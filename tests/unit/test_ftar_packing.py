"""FTAR's packing without a network: tensors into flat staging buffers and back, with the reduction (an
element-wise sum over the members' buffers) done here by hand."""

from __future__ import annotations

import torch

from ftar.packing import Packed, Staging, pack, unpack
from ftar.rules import PROOF_MAX, proof_holds, tag_proof

CPU = torch.device("cpu")
TAG = 7
KW = {"proof": tag_proof(TAG), "world": 3}


def reduce_sum(packs: list[Packed]) -> None:
    """What the data plane does: every member's buffers become the element-wise sum of all of them."""
    for buffers in zip(*(p.buffers() for p in packs), strict=True):
        total = torch.stack(list(buffers)).sum(0)
        for b in buffers:
            b.copy_(total)


def member_tensors(i: int) -> list[torch.Tensor]:
    return [
        torch.full((2, 3), float(i + 1), dtype=torch.float32),
        torch.arange(5, dtype=torch.int64) * (i + 1),
        torch.full((4,), 10.0 * (i + 1), dtype=torch.float64),
        torch.full((3,), 2.0 * (i + 1), dtype=torch.float32),
    ]


def test_round_trip_of_mixed_dtypes_averages_and_sums_exactly() -> None:
    inputs = [member_tensors(i) for i in range(3)]
    originals = [[t.clone() for t in ts] for ts in inputs]
    packs = [pack(ts, contribute=True, keep_inputs=True, staging=Staging(CPU), **KW) for ts in inputs]
    assert len(packs[0].flats) == 3 and not packs[0].separate  # one per dtype; the trailer rides in a float one
    assert not packs[0].direct
    reduce_sum(packs)
    assert packs[0].contributors() == 3
    avg = unpack(packs[0], inputs[0], op="avg", contributors=3, inplace=False)
    assert torch.equal(avg[0], torch.full((2, 3), 2.0))
    assert torch.equal(avg[1], (torch.arange(5) * 6) // 3)
    assert torch.equal(avg[2], torch.full((4,), 20.0, dtype=torch.float64))
    assert torch.equal(avg[3], torch.full((3,), 4.0))
    assert [t.shape for t in avg] == [t.shape for t in inputs[0]]
    assert [t.dtype for t in avg] == [t.dtype for t in inputs[0]]
    assert proof_holds(TAG, packs[0].proof(), 3) and not proof_holds(TAG + 1, packs[0].proof(), 3)
    assert len({t.untyped_storage().data_ptr() for t in avg if t.dtype == torch.float32}) == 1  # views of one
    total = unpack(packs[1], inputs[1], op="sum", contributors=3, inplace=False)
    assert torch.equal(total[1], torch.arange(5) * 6)
    for ts, orig in zip(inputs, originals, strict=True):  # not in place: the inputs are untouched
        assert all(torch.equal(a, b) for a, b in zip(ts, orig, strict=True))


def test_a_non_contributor_sends_zeros_and_is_not_counted() -> None:
    inputs = [member_tensors(0), member_tensors(1)]
    packs = [pack(inputs[0], contribute=True, keep_inputs=True, staging=Staging(CPU), **KW),
             pack(inputs[1], contribute=False, keep_inputs=True, staging=Staging(CPU), **KW)]
    data = [flat[:sum(inputs[1][i].numel() for i in idx)] for flat, idx in packs[1].flats]
    assert all(not d.any() for d in data) and packs[1].trailer[0] == 0  # the tag proof is sent all the same
    reduce_sum(packs)
    assert packs[1].contributors() == 1
    out = unpack(packs[1], inputs[1], op="avg", contributors=1, inplace=False)
    assert all(torch.equal(a, b) for a, b in zip(out, member_tensors(0), strict=True))


def test_without_a_float_tensor_the_count_travels_separately() -> None:
    inputs = [[torch.arange(4, dtype=torch.int64) * (i + 1)] for i in range(2)]
    packs = [pack(ts, contribute=True, keep_inputs=True, staging=Staging(CPU), **KW) for ts in inputs]
    assert packs[0].separate and len(packs[0].buffers()) == 2
    reduce_sum(packs)
    assert packs[0].contributors() == 2
    assert torch.equal(unpack(packs[0], inputs[0], op="sum", contributors=2, inplace=False)[0], torch.arange(4) * 3)


def test_in_place_writes_the_result_into_the_inputs() -> None:
    inputs = [member_tensors(i) for i in range(2)]
    packs = [pack(ts, contribute=True, keep_inputs=True, staging=Staging(CPU), **KW) for ts in inputs]
    reduce_sum(packs)
    out = unpack(packs[0], inputs[0], op="avg", contributors=2, inplace=True)
    assert all(a is b for a, b in zip(out, inputs[0], strict=True))
    assert torch.equal(inputs[0][0], torch.full((2, 3), 1.5))


def test_direct_reduces_the_callers_tensors_where_they_lie() -> None:
    inputs = [[torch.full((6,), float(i + 1)), torch.arange(3, dtype=torch.int64)] for i in range(2)]
    packs = [pack(ts, contribute=True, keep_inputs=False, staging=Staging(CPU), **KW) for ts in inputs]
    assert packs[0].direct and packs[0].separate  # no spare element in the caller's tensor
    assert packs[0].flats[0][0].data_ptr() == inputs[0][0].data_ptr()
    reduce_sum(packs)
    assert torch.equal(inputs[0][0], torch.full((6,), 3.0))  # reduced already, before unpacking
    out = unpack(packs[0], inputs[0], op="avg", contributors=packs[0].contributors(), inplace=True)
    assert torch.equal(out[0], torch.full((6,), 1.5)) and out[0] is inputs[0][0]


def test_direct_falls_back_to_a_copy_when_it_cannot_apply() -> None:
    non_contiguous = torch.ones(3, 4).t()
    assert not pack([non_contiguous], contribute=True, keep_inputs=False, staging=Staging(CPU), **KW).direct
    two_of_a_dtype = [torch.ones(2), torch.ones(3)]
    assert not pack(two_of_a_dtype, contribute=True, keep_inputs=False, staging=Staging(CPU), **KW).direct
    assert not pack([torch.ones(2)], contribute=False, keep_inputs=False, staging=Staging(CPU), **KW).direct


def test_staging_buffers_are_reused_and_grown() -> None:
    staging = Staging(CPU)
    big = staging.get(torch.float32, 100)
    small = staging.get(torch.float32, 10)
    assert small.data_ptr() == big.data_ptr() and small.numel() == 10
    bigger = staging.get(torch.float32, 200)
    assert bigger.numel() == 200
    assert staging.get(torch.float64, 10).dtype == torch.float64


def test_the_tag_proof_travels_separately_when_a_float32_sum_would_not_be_exact() -> None:
    world = 2**24 // PROOF_MAX + 1  # world * PROOF_MAX reaches 2**24
    tensors = [torch.ones(3, dtype=torch.float32)]
    p32 = pack(tensors, contribute=True, keep_inputs=True, staging=Staging(CPU), proof=tag_proof(-1), world=world)
    assert p32.separate and p32.trailer.dtype == torch.int64
    p64 = pack([torch.ones(3, dtype=torch.float64)], contribute=True, keep_inputs=True, staging=Staging(CPU),
               proof=tag_proof(-1), world=world)
    assert not p64.separate  # float64 is exact far beyond


def test_the_trailer_does_not_change_what_is_sent_for_the_data() -> None:
    a, b = [torch.randn(5)], [torch.randn(5)]
    packs = [pack(ts, contribute=True, keep_inputs=True, staging=Staging(CPU), proof=tag_proof(TAG), world=2)
             for ts in (a, b)]
    reduce_sum(packs)
    out = unpack(packs[0], a, op="sum", contributors=2, inplace=False)
    assert torch.equal(out[0], a[0] + b[0]) and packs[0].contributors() == 2 and proof_holds(TAG, packs[0].proof(), 2)


def test_where_the_trailer_travels_does_not_depend_on_the_members_own_tag() -> None:
    world = 2**24 // 9  # a tag with digits of at most 3 alone would fit a float32 sum, one with 15 not
    small, large = (pack([torch.ones(3)], contribute=True, keep_inputs=True, staging=Staging(CPU),
                         proof=tag_proof(t), world=world) for t in (0x3333, 0xFFFF))
    assert small.separate and large.separate and len(small.buffers()) == len(large.buffers())


def test_a_proof_summed_with_other_data_is_refused_not_raised() -> None:
    summed = [float(2 * v) for v in tag_proof(TAG)]
    for bad in (float("nan"), float("inf"), 1e30):
        assert not proof_holds(TAG, [bad, *summed[1:]], 2)
