"""runtime.link.pending.PendingTable: the one table of requests in flight, with deadlines."""

from __future__ import annotations

import threading

import pytest

from runtime.link.pending import Entry, PendingTable

pytestmark = pytest.mark.timeout(30)


def test_a_reply_and_a_deadline_race_and_exactly_one_wins():
    for _ in range(200):
        table: PendingTable[Entry] = PendingTable()
        entry = Entry(("peer", 1), deadline=0.0)
        table.add(entry)
        won: list[str] = []
        barrier = threading.Barrier(2)

        def reply() -> None:
            barrier.wait()
            if table.claim(("peer", 1)) is not None:
                won.append("reply")

        def deadline() -> None:
            barrier.wait()
            won.extend("deadline" for _ in table.expired(1.0))

        threads = [threading.Thread(target=reply), threading.Thread(target=deadline)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(won) == 1
        assert len(table) == 0


def test_expired_gives_only_the_due_unclaimed_entries_in_deadline_order():
    table: PendingTable[Entry] = PendingTable()
    late, early, none, answered = Entry(1, 5.0), Entry(2, 1.0), Entry(3), Entry(4, 0.5)
    for entry in (late, early, none, answered):
        table.add(entry)
    assert table.claim(4) is answered
    assert table.next_deadline() == 1.0
    assert table.expired(2.0) == [early]
    assert table.expired(2.0) == []
    assert sorted(table.table) == [1, 3]
    assert table.expired(10.0) == [late]
    assert table.next_deadline() is None
    assert table.claim(3) is none and len(table) == 0


def test_keep_answers_an_entry_but_leaves_it_in_the_table_until_removed():
    left: list[Entry] = []
    table: PendingTable[Entry] = PendingTable(on_leave=left.append)
    entry = Entry("a", deadline=1.0)
    table.add(entry)
    assert table.expired(2.0, keep=True) == [entry]
    assert "a" in table and left == []
    assert not table.claim_entry(entry)  # the engine's late outcome: answered already
    assert table.remove(entry) and left == [entry]
    assert not table.remove(entry)


def test_take_all_fails_what_is_unclaimed_and_empties_the_table():
    table: PendingTable[Entry] = PendingTable()
    kept, open_ = Entry(1, 0.0), Entry(2, 9.0)
    table.add(kept)
    table.add(open_)
    table.expired(1.0, keep=True)
    assert table.take_all() == [open_]
    assert len(table) == 0 and table.next_deadline() is None
    assert table.claim(2) is None


def test_counts_follow_entries_in_and_out():
    counts = {"peer": 0}
    table: PendingTable[Entry] = PendingTable(on_enter=lambda e: counts.__setitem__(e.key[0], counts[e.key[0]] + 1),
                                              on_leave=lambda e: counts.__setitem__(e.key[0], counts[e.key[0]] - 1))
    entries = [Entry(("peer", i), float(i)) for i in range(5)]
    for entry in entries:
        table.add(entry)
    assert counts["peer"] == 5
    table.claim(("peer", 0))
    table.expired(2.5)  # 1 and 2
    table.take_all()
    assert counts["peer"] == 0


def test_the_heap_does_not_keep_answered_entries_alive():
    table: PendingTable[Entry] = PendingTable()
    for i in range(10_000):
        entry = Entry(i, deadline=1e9)
        table.add(entry)
        table.claim(i)
    assert len(table._heap) <= 2 * len(table) + 64 + 1


def test_the_locked_variants_let_an_owner_add_and_claim_under_its_own_hold_of_the_lock():
    table: PendingTable[Entry] = PendingTable()
    with table.lock:  # one acquisition: the owner's own state and the table change together
        table.add_locked(Entry(1))
        assert table.claim_locked(2) is None
    assert 1 in table
    with table.lock:
        entry = table.claim_locked(1)
        assert entry is not None and entry.claimed and table.claim_locked(1) is None
    assert len(table) == 0


def test_peek_deadline_reads_the_heap_without_the_lock_and_may_see_an_answered_entry():
    table: PendingTable[Entry] = PendingTable()
    assert table.peek_deadline() is None
    early, late = Entry(1, 1.0), Entry(2, 5.0)
    table.add(early)
    table.add(late)
    assert table.peek_deadline() == 1.0
    table.claim(1)
    with table.lock:  # no lock taken: it answers while another thread holds it
        assert table.peek_deadline() == 1.0  # the answered entry is still on top
    assert table.expired(2.0) == []  # and nothing is due for it
    assert table.peek_deadline() == 5.0


def test_earliest_names_the_unclaimed_entry_due_first_without_claiming_it():
    table: PendingTable[Entry] = PendingTable()
    assert table.earliest() is None
    late, early, none = Entry("late", 5.0), Entry("early", 1.0), Entry("none")
    for entry in (late, early, none):
        table.add(entry)
    assert table.earliest() is early and not early.claimed
    assert table.claim("early") is early
    assert table.earliest() is late and table.next_deadline() == 5.0
    assert [e.key for e in table.take_all()] == ["late", "none"]
    assert table.earliest() is None
