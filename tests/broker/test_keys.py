"""Hash tags: each session's keys, and each job's index, live in one Redis Cluster slot."""

from __future__ import annotations

from redis.crc import key_slot

from breakpod_broker import keys


def test_every_key_of_one_session_hashes_to_one_slot_and_sessions_spread():
    for session_id in ("s1", "job-7.rank-1023", "a" * 128):
        slots = {
            key_slot(k.encode())
            for k in (
                keys.session(session_id),
                keys.alive(session_id),
                keys.session_events(session_id),
                keys.seen(session_id, "e1"),
                keys.seen(session_id, "another-event"),
                keys.commands(session_id),
                keys.delivered(session_id),
            )
        }
        assert len(slots) == 1, session_id
    assert len({key_slot(keys.session(f"rank-{i}").encode()) for i in range(100)}) > 90


def test_a_job_index_is_one_key_in_the_slot_of_its_job_name():
    assert key_slot(keys.job_sessions("train").encode()) == key_slot(b"train")
    assert key_slot(keys.namespace_sessions("ml").encode()) == key_slot(b"ml")
