"""The agent's poll thread polls at the busy interval while there is work, at the idle one
once there has been none for `idle_after_s`, and work wakes it at once. Time passes on a
FakeClock; the intervals are long, so the thread polls only when woken."""

from __future__ import annotations

import threading

import pytest

from pdserve.kvtransfer import poller as poller_module
from pdserve.kvtransfer.poller import Poller
from tests.fake_clock import FakeClock

BUSY_S, IDLE_S = 1000.0, 5000.0


@pytest.fixture
def clock(monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr(poller_module, "time", clock)
    return clock


class Polls:
    def __init__(self, found_work: bool = False):
        self.found_work = found_work
        self.count = 0
        self.happened = threading.Event()

    def __call__(self) -> bool:
        self.count += 1
        self.happened.set()
        return self.found_work


def test_busy_then_idle_then_woken_at_once_by_work(clock):
    polls = Polls()
    p = Poller(polls, "test-poller", BUSY_S, IDLE_S, idle_after_s=1.0)
    try:
        assert p.next_wait() == BUSY_S and not p.idle  # a new agent is wiring up
        clock.advance(1.5)
        assert p.idle and p.next_wait() == IDLE_S
        assert polls.count == 0
        p.stay_active(30.0)  # e.g. a decode node granted a lease: writes are coming
        assert polls.happened.wait(10), "work did not wake the idle poller"
        assert not p.idle and p.next_wait() == BUSY_S
        clock.advance(29.0)
        assert not p.idle
        clock.advance(1.5)
        assert p.idle
    finally:
        p.close()


def test_a_shorter_stay_never_cuts_a_longer_one(clock):
    p = Poller(Polls(), "test-poller", BUSY_S, IDLE_S, idle_after_s=1.0)
    try:
        p.stay_active(60.0)
        p.stay_active(2.0)
        clock.advance(30.0)
        assert not p.idle
    finally:
        p.close()


def test_a_poll_that_finds_work_keeps_it_busy(clock):
    polls = Polls(found_work=True)
    p = Poller(polls, "test-poller", BUSY_S, IDLE_S, idle_after_s=1.0)
    try:
        clock.advance(5.0)
        assert p.idle
        p.stay_active(0.0)  # wakes it (it was idle) without itself extending anything
        assert polls.happened.wait(10)
    finally:
        p.close()  # joins the thread: the poll's outcome has been acted on
    # the poll found notifications, so the thread stayed busy for idle_after_s from then
    assert not p.idle


def test_close_stops_the_thread_and_bad_intervals_are_refused():
    p = Poller(Polls(), "test-poller", BUSY_S, IDLE_S, idle_after_s=1.0)
    p.close()
    assert not p._thread.is_alive()
    with pytest.raises(ValueError, match="no shorter"):
        Poller(Polls(), "bad", 0.1, 0.01, 1.0)


def test_on_start_runs_on_the_polling_thread_before_any_poll():
    # A GPU pool's agent makes its device current there: UCX progress completes CUDA copies.
    seen = []
    polled = threading.Event()

    def poll():
        seen.append(("poll", threading.current_thread().name))
        polled.set()
        return False

    p = Poller(poll, "test-poller", 0.001, 0.001, idle_after_s=1.0,
               on_start=lambda: seen.append(("start", threading.current_thread().name)))
    try:
        assert polled.wait(10)
    finally:
        p.close()
    assert seen[0] == ("start", "test-poller") and seen[1] == ("poll", "test-poller")
