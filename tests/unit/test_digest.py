"""The periodic state-digest check's pure parts (fthsdp/runtime/digest.py): each replica's digest in its own slot
positions comes back exactly after FTAR's float32 sum and average, whatever the contributor count; the verdict
names the replicas outside a strict majority, or all of them when there is none; and the last bucket carries the
digests (before the slot mask) on the wire. No processes."""

from __future__ import annotations

import hashlib
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from ftar import ExchangeResult
from fthsdp.runtime import digest
from fthsdp.runtime.buckets import BucketExchange
from fthsdp.runtime.digest import Verdict, bits, decide, due, pack, strays, unpack


def _exchange(contributions: list[list[float]], contributors: int) -> list[float]:
    """What FTAR computes: the float32 SUM over every replica (joiners send zeros), divided by the contributors."""
    total = torch.stack([torch.tensor(c, dtype=torch.float32) for c in contributions]).sum(dim=0)
    return torch.div(total, contributors).tolist()


def _d(i: int) -> bytes:
    return hashlib.sha256(str(i).encode()).digest()


@given(st.integers(1, 64), st.data())
def test_digests_come_back_exactly_after_a_float32_sum_and_average(slots: int, data: st.DataObject) -> None:
    contributing = data.draw(st.sets(st.integers(0, slots - 1), min_size=1))
    digests = {s: data.draw(st.binary(min_size=8, max_size=32)) for s in contributing}
    joiners = data.draw(st.integers(0, 2))
    sent = [pack(s, slots, d) for s, d in digests.items()] + [pack(0, slots, None)] * joiners
    got = unpack(_exchange(sent, len(digests)), len(digests))
    assert got == {s: int.from_bytes(d[:8], "big") for s, d in digests.items()}


def test_extreme_words_survive_the_average() -> None:
    ones, zeros = b"\xff" * 8, b"\x00" * 8
    sent = [pack(0, 3, ones), pack(1, 3, zeros), pack(2, 3, None)]
    assert unpack(_exchange(sent, 2), 2) == {0: 2 ** 64 - 1, 1: 0}  # a zero digest is still a digest


def test_packing_puts_the_digest_in_its_own_slot_only() -> None:
    out = pack(1, 3, bytes(range(8)))
    assert out[:digest.WORDS] == [0.0] * digest.WORDS and out[2 * digest.WORDS:] == [0.0] * digest.WORDS
    assert out[digest.WORDS:2 * digest.WORDS] == [0x0001 + 1, 0x0203 + 1, 0x0405 + 1, 0x0607 + 1]
    assert pack(1, 3, None) == [0.0] * 3 * digest.WORDS
    with pytest.raises(ValueError):
        pack(3, 3, bytes(8))
    with pytest.raises(ValueError):
        pack(0, 3, bytes(7))


def test_two_replicas_writing_one_slot_are_refused() -> None:
    sent = [pack(1, 2, b"\xff" * 8), pack(1, 2, b"\xff" * 8)]
    with pytest.raises(ValueError, match="same slot"):
        unpack(_exchange(sent, 2), 2)


@pytest.mark.parametrize(("digests", "differ", "majority"), [
    ({0: 7, 1: 7, 2: 7}, (), True),
    ({0: 7}, (), True),
    ({}, (), True),
    ({0: 7, 1: 9, 2: 7}, (1,), True),
    ({0: 7, 1: 9, 2: 9, 3: 9}, (0,), True),
    ({0: 7, 1: 9, 2: 7, 3: 9}, (0, 1, 2, 3), False),  # a tie: nobody can tell
    ({0: 7, 1: 9}, (0, 1), False),
    ({0: 1, 1: 2, 2: 3}, (0, 1, 2), False),
    ({0: 1, 1: 2, 2: 3, 3: 3, 4: 3}, (0, 1), True),
])
def test_the_verdict_names_who_differs_from_a_strict_majority(digests: dict[int, int], differ: tuple[int, ...],
                                                               majority: bool) -> None:
    v = decide(digests)
    assert v == Verdict(digests, differ, majority)
    assert v.agree == (not differ)


def test_the_verdict_does_not_depend_on_order() -> None:
    digests = {0: 5, 1: 5, 2: 6, 3: 5, 4: 8}
    for _ in range(10):
        items = list(digests.items())
        random.shuffle(items)
        assert decide(dict(items)).differ == (2, 4)


def test_checked_steps() -> None:
    assert [s for s in range(25) if due(s, 10)] == [0, 10, 20]
    assert not any(due(s, 0) for s in range(25))


def test_the_last_bucket_carries_the_digests_before_the_slot_mask() -> None:
    slots = 3
    words = _exchange([pack(0, slots, _d(0)), pack(2, slots, _d(1))], 2)
    tensors = [torch.zeros(2), torch.tensor(words, dtype=torch.float32), torch.tensor([0.5, 0.0, 0.5])]
    result = ExchangeResult(tensors, 1, 2, 1, 0)
    assert BucketExchange.digests_of([result]) == {0: int.from_bytes(_d(0)[:8], "big"),
                                                   2: int.from_bytes(_d(1)[:8], "big")}
    assert BucketExchange.mask_of([result]) == [0.5, 0.0, 0.5]


@pytest.mark.parametrize(("own", "digests", "stray"), [
    (7, {0: 7, 1: 7}, False),
    (9, {0: 7, 1: 7}, True),
    (9, {0: 7, 1: 9, 2: 7}, True),  # the slots' majority is 7, whatever slot 1 holds
    (7, {0: 7, 1: 9, 2: 7}, False),
    (9, {0: 7, 1: 9}, False),  # no majority: the slots stop the job, the spare cannot tell either
    (9, {}, False),  # nobody sent one (every slot's replica caught up this step)
])
def test_a_spare_holds_its_digest_against_the_slots_majority(own: int, digests: dict[int, int], stray: bool) -> None:
    assert strays(own, decide(digests)) == stray


def test_the_compared_bits_are_the_ones_the_exchange_gives_back() -> None:
    digest = bytes(range(1, 33))
    assert unpack(_exchange([pack(0, 1, digest)], 1), 1) == {0: bits(digest)}


def test_a_spare_that_differs_raises_diverged_only_for_the_step_it_digested() -> None:
    from fthsdp.runtime.agreement import DigestCheck
    from fthsdp.runtime.errors import Diverged

    words = _exchange([pack(0, 2, _d(0)), pack(1, 2, _d(0))], 2)
    result = ExchangeResult([torch.zeros(2), torch.tensor(words, dtype=torch.float32), torch.ones(2)], 1, 2, 1, 0)
    logged: list[str] = []
    check = DigestCheck(10, lambda: -1, lambda level, msg, *args: logged.append(msg % args))
    check.check_own(10, (10, _d(0)), [result])  # the same state
    check.check_own(10, (10, None), [result])  # not a checked step
    check.check_own(10, (9, _d(1)), [result])  # digested before another step: nothing to compare
    assert logged == []
    with pytest.raises(Diverged, match="this spare's state .* differs from the majority's at step 10"):
        check.check_own(10, (10, _d(1)), [result])
    assert len(logged) == 1
