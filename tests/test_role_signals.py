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
from distbelief.runtime import roles
stop = roles._stop_on_termination()
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


def test_a_burst_of_sigterms_never_hangs_a_role() -> None:
    role = _role("busy")
    try:
        started = time.monotonic()
        while time.monotonic() - started < 2.0:
            os.kill(role.pid, signal.SIGTERM)
        out, _ = role.communicate(timeout=30)
    finally:
        role.kill()
    assert (role.returncode, out.strip()) == (0, "set")


def test_one_sigterm_sets_a_role_s_stop() -> None:
    role = _role("idle")
    try:
        os.kill(role.pid, signal.SIGTERM)
        out, _ = role.communicate(timeout=30)
    finally:
        role.kill()
    assert (role.returncode, out.strip()) == (0, "set")


def test_sigusr2_writes_every_thread_s_stack_to_the_log() -> None:
    role = _role("idle", stderr=subprocess.PIPE)
    try:
        os.kill(role.pid, signal.SIGUSR2)
        time.sleep(0.5)
        os.kill(role.pid, signal.SIGTERM)
        out, err = role.communicate(timeout=30)
    finally:
        role.kill()
    assert (role.returncode, out.strip()) == (0, "set")  # a dump, not a death
    assert "Current thread" in err and 'File "<string>"' in err
