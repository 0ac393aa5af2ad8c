"""Checkpoints of embedding rows restorable after SIGKILL at any moment of a step."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from support.paths import TESTS
from support.rowshards import make_shard, replay, snapshot, table

CHILD = """
import sys
sys.path.insert(0, {tests!r})
import numpy as np
from support.rowshards import make_shard, step, keys_of_step
from pathlib import Path
shard = make_shard(Path({folder!r}))
print(shard.step, flush=True)
while True:
    step(shard, keys_of_step(shard.step + 1))
    print(shard.step, flush=True)
"""


def test_a_shard_killed_at_any_moment_restores_exactly_the_rows_of_its_last_checkpoint(tmp_path: Path) -> None:
    """A process checkpointing every step (bases, deltas, compactions, pruning) is SIGKILLed
    after a random number of steps, at a random moment of the next one, then restarted on
    the same folder: each restore equals a replay of the steps its checkpoint covers, and
    no step that was reported checkpointed is lost."""
    code = CHILD.format(tests=str(TESTS), folder=str(tmp_path))
    rng = np.random.default_rng(7)
    last = 0
    for _ in range(6):
        child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        lines = iter(child.stdout)  # type: ignore[arg-type]
        assert int(next(lines)) == last
        for _ in range(int(rng.integers(3, 25))):
            done = int(next(lines))
        time.sleep(float(rng.uniform(0, 0.004)))
        child.send_signal(signal.SIGKILL)
        child.wait()
        child.stdout.close()  # type: ignore[union-attr]
        restored = make_shard(tmp_path)
        assert restored.step >= done
        assert snapshot(table(restored)) == replay(restored.step)
        last = restored.step
