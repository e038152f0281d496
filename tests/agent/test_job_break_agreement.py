"""A job-wide break parks every rank at one step, however late a rank hears of it
(two ranks' pauses on one real torch store, stepped by hand)."""

from __future__ import annotations

import pytest

from breakpod._job import board as job
from breakpod._job import pause as job_pause

torch_distributed = pytest.importorskip("torch.distributed")


def ranks(n: int = 2) -> list[tuple[job_pause.JobPause, job.Board]]:
    store = torch_distributed.HashStore()
    pairs = []
    for rank in range(n):
        place = job.Place(rank=rank, world_size=n, host=None, port=None, run_id="t/0")
        pairs.append((job_pause.JobPause(place), job.Board(store, place)))
    return pairs


def boundaries(pause: job_pause.JobPause, first: int, last: int) -> int | None:
    """Step boundaries ``first..last`` in the training thread; the one it parks at."""
    return next((s for s in range(first, last + 1) if pause.parks_at(s)), None)


def test_ranks_that_hear_in_time_park_at_the_proposed_step():
    (zero, board0), (one, board1) = ranks()
    boundaries(zero, 0, 3)
    boundaries(one, 0, 3)
    zero.break_wanted = True
    zero.tick(board0, False, 3, speed=None)
    one.tick(board1, False, 3, speed=None)
    assert zero.break_at == one.break_at == 4
    assert boundaries(zero, 4, 10) == boundaries(one, 4, 10) == 4


def test_a_rank_past_the_step_moves_the_break_and_every_rank_follows():
    (zero, board0), (one, board1) = ranks()
    boundaries(zero, 0, 3)
    boundaries(one, 0, 6)  # rank 1 runs ahead of its slow watchdog tick
    zero.break_wanted = True
    zero.tick(board0, False, 3, speed=None)  # proposes step 4
    one.tick(board1, False, 6, speed=None)  # already passed step 4: moves the break
    assert one.break_at == 7 and board1.get(job_pause.BREAK_KEY)["step"] == 7
    zero.tick(board0, False, 3, speed=None)
    assert zero.break_at == 7
    assert boundaries(zero, 4, 20) == boundaries(one, 7, 20) == 7


def test_a_rank_parked_at_the_old_step_continues_to_the_new_one():
    (zero, board0), (one, board1) = ranks()
    zero.break_wanted = True
    zero.tick(board0, False, 0, speed=None)  # step 1
    assert boundaries(zero, 0, 5) == 1  # parked (waiting for a client)
    boundaries(one, 0, 2)  # blocked behind rank 0 after step 2's boundary
    one.tick(board1, False, 2, speed=0.5)  # 2 s ahead at 0.5 s a step: step 2 + 5
    zero.tick(board0, True, 1, speed=None)
    assert zero.break_at == one.break_at == 7
    assert boundaries(zero, 2, 20) == boundaries(one, 3, 20) == 7


def test_a_boundary_that_races_the_tick_is_never_skipped():
    """The tick decides under the training thread's lock: a boundary passed just before
    it adopts the break counts as passed, so no rank parks one step late."""
    (zero, board0), (one, board1) = ranks()
    zero.break_wanted = True
    zero.tick(board0, False, 0, speed=None)
    assert board0.get(job_pause.BREAK_KEY)["step"] == 1
    one.parks_at(1)  # rank 1 passed step 1 while its tick was on its way
    one.tick(board1, False, 0, speed=None)  # its step number read before that boundary
    assert one.break_at == 2 and board1.get(job_pause.BREAK_KEY)["step"] == 2


def test_a_peer_killed_while_parked_is_not_waited_for_forever(monkeypatch):
    """The peer's record stops changing (its watchdog died with it): after PEER_SILENT the
    waiting rank stops waiting, says why, and does not pause for it again. Before, it
    waited in ``wait_at_step`` for ever (a job not launched by one torchrun)."""
    import time

    monkeypatch.setattr(job_pause, "PEER_SILENT", 0.3)
    monkeypatch.setattr(job_pause, "LOOK_EVERY", 0.05)
    (zero, board0), (one, board1) = ranks()
    one.park_note = {"where": "train.py:3", "why": "breakpoint"}
    one.tick(board1, True, 3, speed=None)  # parks: the counter and its note
    board1.publish({"rank": 1, "state": "parked", "time": 1.0})  # its last record
    zero.tick(board0, False, 3, speed=None)
    assert zero.paused and zero.peers == [1]
    deadline = time.monotonic() + 5
    while zero.paused and time.monotonic() < deadline:
        time.sleep(0.05)
        zero.tick(board0, False, 3, speed=None)
    assert not zero.paused and zero.gone == {1} and not zero.peer_parked
    for _ in range(3):  # the counter still holds rank 1's park: no pause for it again
        zero.tick(board0, False, 4, speed=None)
    assert not zero.paused


def test_a_peer_that_resumes_takes_its_note_with_it():
    (_, board0), (one, board1) = ranks()
    one.park_note = {"where": "train.py:3", "why": "breakpoint"}
    one.tick(board1, True, 3, speed=None)
    assert board0.get("park/1")
    one.tick(board1, False, 3, speed=None)
    assert not board0.get("park/1")


def test_a_peer_taken_for_gone_that_reports_again_is_waited_for_again(monkeypatch):
    """Its record changes again (its watchdog was only slow): it counts again, and a
    second park of it pauses this rank; a silent one among two parked does not release
    the rank from the other."""
    import time

    monkeypatch.setattr(job_pause, "PEER_SILENT", 0.2)
    monkeypatch.setattr(job_pause, "LOOK_EVERY", 0.0)
    (zero, board0), (one, board1), (two, board2) = ranks(3)
    for peer, board in ((one, board1), (two, board2)):
        peer.park_note = {"where": "train.py:3", "why": "breakpoint"}
        peer.tick(board, True, 3, speed=None)
    board1.publish({"rank": 1, "state": "parked", "time": 1.0})
    board2.publish({"rank": 2, "state": "parked", "time": 1.0})
    zero.tick(board0, False, 3, speed=None)
    assert zero.paused and zero.peers == [1, 2]
    time.sleep(0.3)
    board2.publish({"rank": 2, "state": "parked", "time": 2.0})  # rank 2 is alive
    zero.tick(board0, False, 3, speed=None)
    assert zero.gone == {1} and zero.paused  # still waits for rank 2
    board1.publish({"rank": 1, "state": "parked", "time": 3.0})  # rank 1 reports again
    zero.tick(board0, False, 3, speed=None)
    assert zero.gone == set() and zero.paused and zero.peer_parked
