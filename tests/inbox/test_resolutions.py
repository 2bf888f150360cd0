"""The inbox's side of the dead queue's commands (inbox/resolutions.py), on SQLite and PostgreSQL alike:
receipts of dead letters, the rejection each dead letter resolves, those whose copy is gone, a fresh
poison budget, and ``rejected resolve``'s choice of rows."""

from __future__ import annotations

from typing import Any

from support import env

from delivery_consumer.inbox import apply_event, resolutions

ADD = ("INSERT INTO rejected (code, reason, event_id, body_sha256, dead_letter, rejected_at)"
       " VALUES ('malformed-json', 'x', ?, ?, ?, '2026-01-01T00:00:00.000Z')")


def unresolved(db: Any) -> list[tuple[Any, ...]]:
    return [tuple(row) for row in db.conn.execute(
        "SELECT event_id, body_sha256 FROM rejected WHERE resolved_at IS NULL ORDER BY id").fetchall()]


def test_receipts_of_dead_letters(open_inbox: Any) -> None:
    """Only the eventIds that have a receipt are answered, with their fingerprint and result."""
    db = open_inbox("catalog")
    applied = env()
    apply_event(db, applied)
    assert {applied.event_id: (applied.fingerprint, "updated")} == resolutions.receipts_of(
        db, [applied.event_id, "01938b10-0000-7000-8000-00000000dead"])


def test_each_dead_letter_resolves_one_row_of_its_queue(open_inbox: Any) -> None:
    """A letter resolves one unresolved row of its dead queue with its body digest (or, for a row without
    a digest, its eventId), filling in an eventId read from its body; another queue's row stays."""
    db = open_inbox("catalog")
    db.conn.executemany(ADD, [(None, "d1", "q.dead"), (None, "d1", "q.dead"), ("e2", None, "q.dead"),
                              (None, "d3", "q.other")])
    letters = [resolutions.Letter("d1", "e1", True), resolutions.Letter("x2", "e2", False),
               resolutions.Letter("d3", "e3", True)]
    assert 2 == resolutions.resolve_letters(db, "q.dead", letters)
    assert [(None, "d1"), (None, "d3")] == unresolved(db)
    assert [("e1",)] == db.conn.execute("SELECT event_id FROM rejected WHERE body_sha256 = 'd1'"
                                        " AND resolved_at IS NOT NULL").fetchall()


def test_rows_whose_copy_left_the_queue_are_resolved(open_inbox: Any) -> None:
    """resolve_gone resolves the rows recorded before the read whose digest the read did not find."""
    db = open_inbox("catalog")
    db.conn.executemany(ADD, [("e1", "gone", "q.dead"), ("e2", "here", "q.dead"), ("e3", "gone2", "q.other")])
    assert 1 == resolutions.resolve_gone(db, "q.dead", {"here"}, "2026-06-01T00:00:00.000Z")
    assert 0 == resolutions.resolve_gone(db, "q.dead", set(), "2025-01-01T00:00:00.000Z")  # recorded after
    assert [("e2", "here"), ("e3", "gone2")] == unresolved(db)


def test_a_requeued_copy_gets_a_fresh_poison_budget(open_inbox: Any) -> None:
    """reset_counts clears the crash count of the delivery keys given and marks them requeued, only those."""
    db = open_inbox("catalog")
    db.conn.executemany("INSERT INTO deliveries (key, event_id, deliveries, redeliveries, attempts, crashes,"
                        " first_at, last_at, last_outcome) VALUES (?, NULL, 3, 2, 1, 2, 't', 't', 'crashed')",
                        [("k1",), ("k2",)])
    resolutions.reset_counts(db, ["k1"])
    resolutions.reset_counts(db, [])
    assert [("k1", 0, "requeued"), ("k2", 2, "crashed")] == [tuple(row) for row in db.conn.execute(
        "SELECT key, crashes, last_outcome FROM deliveries ORDER BY key").fetchall()]


def test_resolve_by_hand_leaves_dead_lettered_and_resolved_rows(open_inbox: Any) -> None:
    """By ids: a row without a copy is resolved, one whose copy went to a dead queue is left, one already
    resolved is left saying when, an unknown id is missing; by time and code: only that code's."""
    db = open_inbox("catalog")
    db.conn.executemany(ADD, [("e1", None, None), ("e2", None, "q.dead"), ("e3", None, None), ("e4", None, None)])
    db.conn.execute("UPDATE rejected SET code = 'invalid-envelope' WHERE event_id = 'e4'")
    first, dead, third, fourth = [row[0] for row in db.conn.execute("SELECT id FROM rejected ORDER BY id")]
    done = resolutions.resolve_by_hand(db, ids=[first, dead, 999])
    assert ([first], [dead], [999]) == (done.resolved, [i for i, _ in done.left], done.missing)
    again = resolutions.resolve_by_hand(db, ids=[first])
    assert [] == again.resolved and again.left[0][1].startswith("already resolved at ")
    by_code = resolutions.resolve_by_hand(db, before="2026-06-01T00:00:00.000Z", code="invalid-envelope")
    assert [fourth] == by_code.resolved
    assert [("e2", None), ("e3", None)] == unresolved(db)
    assert [third] == resolutions.resolve_by_hand(db, before="2026-06-01T00:00:00.000Z", dry_run=True).resolved
    assert [("e2", None), ("e3", None)] == unresolved(db)
