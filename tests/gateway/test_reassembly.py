from __future__ import annotations

import random

import pytest

from services.gateway.reassembly import TokenReassembler


def test_in_order_chunks_pass_straight_through():
    r = TokenReassembler()
    assert r.add(0, [10, 11]) == [10, 11]
    assert r.add(2, [12]) == [12]
    assert r.next_index == 3 and r.buffered == 0


def test_a_gap_is_buffered_until_filled():
    r = TokenReassembler()
    assert r.add(2, [12, 13]) == []
    assert r.buffered == 2 and r.missing == [0, 1]
    assert r.add(0, [10]) == [10]
    assert r.missing == [1]
    assert r.add(1, [11]) == [11, 12, 13]
    assert r.next_index == 4 and r.buffered == 0 and r.missing == []


def test_duplicates_are_dropped():
    r = TokenReassembler()
    assert r.add(0, [10, 11]) == [10, 11]
    assert r.add(0, [10, 11]) == []
    assert r.add(3, [13]) == []
    assert r.add(3, [13]) == []  # redelivered while still buffered
    assert r.add(2, [12]) == [12, 13]
    assert r.duplicates == 3 and r.conflicts == 0


def test_handoff_overlap_emits_each_position_once():
    # relay-decode sent [a, b] at index 3; main-decode resends b and goes on: [b, c] at index 4
    r = TokenReassembler()
    assert r.add(0, [1, 2, 3]) == [1, 2, 3]
    assert r.add(3, [100, 101]) == [100, 101]
    assert r.add(4, [101, 102]) == [102]
    assert r.next_index == 6


def test_overlap_arriving_before_the_chunk_it_overlaps():
    r = TokenReassembler()
    assert r.add(4, [101, 102]) == []
    assert r.add(0, [1, 2, 3]) == [1, 2, 3]
    assert r.add(3, [100, 101]) == [100, 101, 102]


def test_a_conflicting_token_is_counted_and_the_first_one_kept():
    r = TokenReassembler()
    assert r.add(0, [1, 2]) == [1, 2]
    assert r.add(1, [9, 3]) == [3]  # position 1 was already sent as 2
    assert r.conflicts == 1
    assert r.add(5, [50]) == []
    assert r.add(5, [51]) == []
    assert r.conflicts == 2
    assert r.add(3, [30, 40]) == [30, 40, 50]  # position 2 was filled by the 3 above


def test_empty_chunk_and_start_offset():
    r = TokenReassembler(start=5)
    assert r.add(9, []) == []
    assert r.add(3, [7, 7]) == []  # before the start: already delivered elsewhere
    assert r.add(5, [1]) == [1]
    assert r.next_index == 6


def test_negative_index_is_refused():
    with pytest.raises(ValueError):
        TokenReassembler().add(-1, [1])


@pytest.mark.parametrize("seed", range(20))
def test_any_order_with_duplicates_and_overlaps_gives_the_sequence_once(seed):
    rng = random.Random(seed)
    tokens = [rng.randrange(1000) for _ in range(60)]
    chunks = []
    for _ in range(40):  # random, overlapping windows, plus a cover of everything
        start = rng.randrange(len(tokens))
        end = min(len(tokens), start + rng.randrange(1, 8))
        chunks.append((start, tokens[start:end]))
    chunks += [(i, tokens[i : i + 5]) for i in range(0, len(tokens), 5)]
    chunks += rng.sample(chunks, 10)  # redeliveries
    rng.shuffle(chunks)
    r, out = TokenReassembler(), []
    for index, ids in chunks:
        new = r.add(index, ids)
        assert len(out) + len(new) == r.next_index
        out += new
    assert out == tokens and r.buffered == 0 and r.conflicts == 0
