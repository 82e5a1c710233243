"""Sequence tracking (engine-events-and-subscriber.md §3.2, §13 items 18-20)."""

from __future__ import annotations

from inferencecache.subscriber.sequence import Seq, SequenceTracker


def test_s13_18_consecutive_seqs_have_no_gap() -> None:
    t = SequenceTracker()
    assert [t.observe(s).kind for s in (0, 1, 2)] == [Seq.FIRST, Seq.NEXT, Seq.NEXT]


def test_s13_19_gap_counts_the_missing_batches() -> None:
    t = SequenceTracker()
    t.observe(2)
    v = t.observe(5)
    assert (v.kind, v.last, v.missed) == (Seq.GAP, 2, 2)


def test_s13_20_seq_going_back_is_a_restart() -> None:
    t = SequenceTracker()
    for s in range(8):
        t.observe(s)
    v = t.observe(0)
    assert (v.kind, v.last) == (Seq.RESTART, 7)
    assert t.observe(1).kind is Seq.NEXT
    assert t.observe(1).kind is Seq.RESTART  # a repeat is never normal


def test_first_message_after_reset_is_accepted_whatever_its_value() -> None:
    t = SequenceTracker()
    t.observe(3)
    t.reset()
    v = t.observe(9)
    assert (v.kind, v.last, v.missed) == (Seq.FIRST, None, 0)
    assert t.last == 9
