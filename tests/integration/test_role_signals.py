"""A role's stop on SIGTERM: set by the signal, and never hung by a burst of them (a
parent's death delivers one SIGTERM per thread of the parent; a handler that took the
stop event's lock while the main thread held it would wait for it forever)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# A role's main thread: with "busy", it sets the stop event without pause for 3 s (a role's
# own stop calls take the event's lock the same way); with "idle", it waits up to 10 s for
# a signal to set it. It prints whether the event is set.
ROLE = """
import sys, time
from distbelief.runtime.roles import common
stop = common.stop_on_termination()
print("ready", flush=True)
if sys.argv[1] == "busy":
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        stop.set()
else:
    stop.wait(10)
print("set" if stop.is_set() else "not set", flush=True)
"""


def _role(mode: str, **kwargs) -> subprocess.Popen:
    role = subprocess.Popen([sys.executable, "-c", ROLE, mode], stdout=subprocess.PIPE, text=True, **kwargs)
    assert role.stdout.readline().strip() == "ready"
    return role


def _ended(role: subprocess.Popen, send) -> tuple[int, str, str | None]:
    """send(pid) the role its signals; then its exit code, stdout and stderr (if piped)."""
    try:
        send(role.pid)
        out, err = role.communicate(timeout=30)
    finally:
        role.kill()
    return role.returncode, out.strip(), err


def _burst(pid: int) -> None:
    started = time.monotonic()
    while time.monotonic() - started < 2.0:
        os.kill(pid, signal.SIGTERM)


def _dump_then_stop(pid: int) -> None:
    os.kill(pid, signal.SIGUSR2)
    time.sleep(0.5)
    os.kill(pid, signal.SIGTERM)


def test_a_burst_of_sigterms_never_hangs_a_role() -> None:
    assert _ended(_role("busy"), _burst)[:2] == (0, "set")


def test_one_sigterm_sets_a_role_s_stop() -> None:
    assert _ended(_role("idle"), lambda pid: os.kill(pid, signal.SIGTERM))[:2] == (0, "set")


def test_sigusr2_writes_every_thread_s_stack_to_the_log() -> None:
    code, out, err = _ended(_role("idle", stderr=subprocess.PIPE), _dump_then_stop)
    assert (code, out) == (0, "set")  # a dump, not a death
    assert "Current thread" in err and 'File "<string>"' in err
