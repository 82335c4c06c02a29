"""A worker's process label, checked by a peer on the same host against real
processes: a running or paused one is there, an ended one (reaped, a zombie,
or its pid reused) is gone, and one the peer cannot see is never called gone."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from agentdispatch.fleet import process_gone, process_label


def _child() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])


def test_a_running_or_paused_process_is_not_gone() -> None:
    child = _child()
    try:
        label = process_label(child.pid)
        assert label.split("/")[1] == str(child.pid)
        assert not process_gone(label)
        child.send_signal(signal.SIGSTOP)  # paused: it may wake up and go on
        assert not process_gone(label)
        child.send_signal(signal.SIGCONT)
        assert not process_gone(process_label())  # this very process
    finally:
        child.kill()
        child.wait()


def test_a_killed_process_is_gone_before_and_after_it_is_waited_for() -> None:
    child = _child()
    label = process_label(child.pid)
    child.kill()
    # Wait for the exit but leave the child unreaped: a zombie.
    os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
    assert process_gone(label)
    child.wait()
    assert process_gone(label)


def test_a_reused_pid_is_told_apart_by_its_start_time() -> None:
    namespace, pid, started = process_label().split("/")
    assert process_gone(f"{namespace}/{pid}/{int(started) + 1}")


def test_what_cannot_be_checked_is_never_called_gone() -> None:
    _, pid, started = process_label().split("/")
    unknown_pid = 2**22 + 1  # above any pid_max: no such process here
    for label in ("", "garbage", f"another-host/{unknown_pid}/1", f"/{pid}/{started}", "x/y/z"):
        assert not process_gone(label), label
