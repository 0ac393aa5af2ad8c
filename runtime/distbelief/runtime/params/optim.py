"""The update rules a shard applies to its slice, by name: plain SGD and Adagrad.

spec.training.optimizer picks one from OPTIMIZERS; a third rule is one more class with
the same four members (name, state, load_state, apply) and a line in that table.

Both update in place in one compiled pass per element (kernels.py), so a push costs no
temporary at all. A large slice is cut into one part per CPU the pod may use (the
compiled loops release the GIL, so the parts run at once). Adagrad follows Dean et al.
(2012): each parameter i gets the rate gamma / sqrt(sum of its squared gradients so far).
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Callable

import numpy as np

EPSILON = 1e-8
# A thread takes a part only if it has at least this many values: handing a part over
# costs tens of microseconds, updating this many values a few hundred. At most
# MAX_THREADS parts: beyond a few cores memory bandwidth, not arithmetic, is the limit.
MIN_VALUES_PER_THREAD = 256 * 1024
MAX_THREADS = 4
CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")

# kernel(start, stop) updates values [start, stop).
Kernel = Callable[[int, int], None]


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


class Parts:
    """[0, size) cut into one contiguous part per thread."""

    def __init__(self, size: int, threads: int | None = None) -> None:
        if threads is None:
            threads = min(MAX_THREADS, pod_cpus(), max(1, size // MIN_VALUES_PER_THREAD))
        cuts = [size * i // threads for i in range(threads + 1)]
        self.parts = list(zip(cuts, cuts[1:]))

    def run(self, kernel: Kernel) -> None:
        """kernel over every part; the calling thread does the first, the pool the rest."""
        others = [_shared_pool().submit(kernel, *part) for part in self.parts[1:]]
        kernel(*self.parts[0])
        for done in others:
            done.result()


def _compiled() -> ModuleType:
    """The compiled loops, imported when the first rule is made: only a shard applies
    updates, and a worker (which imports this module for the ops) never loads numba."""
    from distbelief.runtime.params import kernels
    return kernels


class Sgd:
    name = "sgd"

    def __init__(self, size: int, learning_rate: float, threads: int | None = None) -> None:
        self.learning_rate = np.float32(learning_rate)
        self._parts = Parts(size, threads)
        self._sgd = _compiled().sgd

    def state(self) -> dict[str, np.ndarray]:
        return {}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        pass

    def apply(self, params: np.ndarray, grad: np.ndarray) -> None:
        def kernel(start: int, stop: int) -> None:
            self._sgd(params[start:stop], grad[start:stop], self.learning_rate)
        self._parts.run(kernel)


class Adagrad:
    name = "adagrad"

    def __init__(self, size: int, learning_rate: float, threads: int | None = None) -> None:
        self.learning_rate = np.float32(learning_rate)
        self.accumulator = np.zeros(size, dtype=np.float32)
        self._parts = Parts(size, threads)
        self._adagrad = _compiled().adagrad

    def state(self) -> dict[str, np.ndarray]:
        return {"adagrad_accumulator": self.accumulator}

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        saved = state["adagrad_accumulator"]
        if saved.shape != self.accumulator.shape:
            raise ValueError("saved Adagrad accumulator has another size than the shard")
        self.accumulator[...] = saved

    def apply(self, params: np.ndarray, grad: np.ndarray) -> None:
        acc, lr, eps = self.accumulator, self.learning_rate, np.float32(EPSILON)

        def kernel(start: int, stop: int) -> None:
            self._adagrad(params[start:stop], grad[start:stop], acc[start:stop], lr, eps)
        self._parts.run(kernel)


Optimizer = Sgd | Adagrad
OPTIMIZERS: dict[str, type[Optimizer]] = {cls.name: cls for cls in (Adagrad, Sgd)}


def make_optimizer(name: str, size: int, *, learning_rate: float) -> Optimizer:
    try:
        kind = OPTIMIZERS[name]
    except KeyError:
        raise ValueError(f"unknown optimizer {name!r} (known: {', '.join(OPTIMIZERS)})") from None
    return kind(size, learning_rate)
