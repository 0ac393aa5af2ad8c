"""The update rules a shard applies to its slice, by name: plain SGD and Adagrad.

spec.training.optimizer picks one from OPTIMIZERS; a third rule is one more class with
the same four members (name, state, load_state, apply) and a line in that table.

Both run in place over cache-sized blocks with one preallocated scratch block per
thread, so a push costs no temporary as large as the model. A large slice is cut into
one part per CPU the pod may use (numpy's ufuncs release the GIL, so the parts run at
once). Adagrad follows Dean et al. (2012): each parameter i gets the rate
gamma / sqrt(sum of its squared gradients so far).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np

# 64K float32 values = 256 KiB per operand: the gradient block, its accumulator and
# parameter slices and the scratch (1 MiB together) stay in a 1 MiB L2 cache, and each
# ufunc call covers 4x more data than with 16K blocks (10-25 % faster measured).
BLOCK = 64 * 1024
EPSILON = 1e-8
# A thread takes a part only if it has at least this many blocks: handing a part over
# costs tens of microseconds, a block's update a few. At most MAX_THREADS parts: Adagrad
# with 2 threads ran 1.6-1.75x one thread on 2 cores, and beyond a few cores memory
# bandwidth, not arithmetic, is the limit.
MIN_BLOCKS_PER_THREAD = 4
MAX_THREADS = 4
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")

# kernel(start, stop, scratch) updates values [start, stop) using scratch[: stop - start].
Kernel = Callable[[int, int, np.ndarray], None]


def pod_cpus() -> int:
    """The CPUs the operator gave this pod's BLAS (OMP_NUM_THREADS, from its CPU limit or
    request), else those the process may use: a shard shares its node's cores as BLAS does."""
    given = os.environ.get("OMP_NUM_THREADS", "")
    return int(given) if given.isdigit() and int(given) > 0 else usable_cpus()


def usable_cpus(cpu_max: Path = CGROUP_CPU_MAX) -> int:
    """The CPUs this process may use: its affinity, cut to its cgroup's quota (a pod's CPU limit)."""
    cpus = len(os.sched_getaffinity(0))
    try:
        quota, period = cpu_max.read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):  # no cgroup v2 file (not in a container), or an odd one
        pass
    return cpus


_pool: ThreadPoolExecutor | None = None


def _shared_pool() -> ThreadPoolExecutor:
    """One pool for every rule of the process: a shard holds one rule, a test may build hundreds."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="apply")
    return _pool


class Blocks:
    """[0, size) cut into one contiguous part per thread, each with its own scratch block."""

    def __init__(self, size: int, threads: int | None = None) -> None:
        if threads is None:
            threads = min(MAX_THREADS, pod_cpus(), max(1, size // (MIN_BLOCKS_PER_THREAD * BLOCK)))
        cuts = [size * i // threads for i in range(threads + 1)]
        self.parts = [(start, stop, np.empty(min(BLOCK, stop - start), dtype=np.float32))
                      for start, stop in zip(cuts, cuts[1:])]

    def run(self, kernel: Kernel) -> None:
        """kernel over every block; the calling thread does the first part, the pool the rest."""
        others = [_shared_pool().submit(_over_blocks, kernel, *part) for part in self.parts[1:]]
        _over_blocks(kernel, *self.parts[0])
        for done in others:
            done.result()


def _over_blocks(kernel: Kernel, start: int, stop: int, scratch: np.ndarray) -> None:
    for low in range(start, stop, BLOCK):
        high = min(low + BLOCK, stop)
        kernel(low, high, scratch[: high - low])


class Sgd:
    name = "sgd"

    def __init__(self, size: int, learning_rate: float, threads: int | None = None) -> None:
        self.learning_rate = np.float32(learning_rate)
        self._blocks = Blocks(size, threads)

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        pass

    def apply(self, params: np.ndarray, grad: np.ndarray) -> None:
        def kernel(start: int, stop: int, tmp: np.ndarray) -> None:
            np.multiply(grad[start:stop], self.learning_rate, out=tmp)
            params[start:stop] -= tmp
        self._blocks.run(kernel)


class Adagrad:
    name = "adagrad"

    def __init__(self, size: int, learning_rate: float, threads: int | None = None) -> None:
        self.learning_rate = np.float32(learning_rate)
        self.accumulator = np.zeros(size, dtype=np.float32)
        self._blocks = Blocks(size, threads)

    def state(self) -> dict[str, np.ndarray]:
        return {"adagrad_accumulator": self.accumulator}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        saved = state["adagrad_accumulator"]
        if saved.shape != self.accumulator.shape:
            raise ValueError("saved Adagrad accumulator has another size than the shard")
        self.accumulator[...] = saved

    def apply(self, params: np.ndarray, grad: np.ndarray) -> None:
        acc, lr = self.accumulator, self.learning_rate

        def kernel(start: int, stop: int, tmp: np.ndarray) -> None:
            g, a = grad[start:stop], acc[start:stop]
            np.multiply(g, g, out=tmp)
            a += tmp
            np.sqrt(a, out=tmp)
            tmp += EPSILON
            np.divide(g, tmp, out=tmp)
            tmp *= lr
            params[start:stop] -= tmp
        self._blocks.run(kernel)


Optimizer = Sgd | Adagrad
OPTIMIZERS: dict[str, type[Optimizer]] = {cls.name: cls for cls in (Adagrad, Sgd)}


def make_optimizer(name: str, size: int, *, learning_rate: float) -> Optimizer:
    try:
        kind = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})") from None
    return kind(size, learning_rate)
