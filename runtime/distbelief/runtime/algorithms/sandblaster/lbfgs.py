"""L-BFGS over vectors that live elsewhere: the two-loop recursion and a strong-Wolfe line
search written against VectorSpace, whose operations name vectors by slot and return only
scalars. The coordinator's VectorSpace runs each operation on every shard's slice; a test
can run the same driver on plain numpy arrays.

The state between iterations is a handful of scalars (LbfgsState), committed to the shards
with their vectors, so a restarted coordinator resumes from the last committed iteration.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Protocol

from distbelief.runtime import errors
from distbelief.runtime.algorithms.sandblaster.vectors import Slots

log = logging.getLogger(__name__)

C1, C2 = 1e-4, 0.9          # sufficient decrease and curvature constants (strong Wolfe)
STEP_GROWTH = 2.0           # bracketing: how fast the trial step grows
CURVATURE_EPS = 1e-10       # pairs with s.y <= eps * y.y are skipped (no curvature information)


class VectorSpace(Protocol):
    """Operations on the named vectors (Slots); only scalars come back."""

    def dot(self, a: int, b: int) -> float: ...

    def axpy(self, out: int, alpha: float, a: int) -> None: ...   # out += alpha * a

    def scale(self, out: int, alpha: float) -> None: ...

    def copy(self, out: int, a: int) -> None: ...

    def evaluate(self) -> float:
        """The objective at the trial point XT; leaves its gradient in GT."""
        ...


@dataclasses.dataclass
class LbfgsState:
    iteration: int = 0
    objective: float | None = None     # at X; None until X has been evaluated
    gradient_norm: float = math.inf
    history: list[list[float]] = dataclasses.field(default_factory=list)  # [slot, rho], oldest first
    next_slot: int = 0
    gamma: float = 1.0                 # scaling of the initial inverse Hessian
    evaluations: int = 0
    converged: str | None = None       # why the method stopped, once it has

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> "LbfgsState":
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in doc.items() if k in fields})


@dataclasses.dataclass(frozen=True)
class LbfgsSettings:
    history: int = 10
    gradient_tolerance: float = 1e-5   # stop when |g| <= this
    objective_tolerance: float = 1e-10  # ... or when the relative decrease is below this
    max_line_search: int = 20          # evaluations per line search


class Lbfgs:
    def __init__(self, space: VectorSpace, settings: LbfgsSettings) -> None:
        self.space, self.settings = space, settings
        self.slots = Slots(settings.history)

    def initialize(self) -> LbfgsState:
        """Evaluate the starting point X: the state of iteration 0."""
        space, slots = self.space, self.slots
        space.copy(slots.XT, slots.X)
        state = LbfgsState(objective=space.evaluate(), evaluations=1)
        space.copy(slots.G, slots.GT)
        state.gradient_norm = math.sqrt(space.dot(slots.G, slots.G))
        self._check_convergence(state, previous=None)
        return state

    def iterate(self, state: LbfgsState) -> LbfgsState:
        """One iteration from a committed state; returns the next state to commit."""
        state = dataclasses.replace(state, history=[list(h) for h in state.history])
        space, slots = self.space, self.slots
        slope = self._direction(state)
        if slope >= 0:  # not a descent direction: the history misleads; start over
            state.history = []
            slope = self._steepest_descent()
        first_step = 1.0 if state.history else min(1.0, 1.0 / state.gradient_norm)
        previous = state.objective
        try:
            state.objective = self._line_search(state, slope, first_step)
        except errors.LineSearchFailed:
            state.converged = "NoFurtherDecrease"
            return state
        self._remember_step(state)
        space.copy(slots.X, slots.XT)
        space.copy(slots.G, slots.GT)
        state.gradient_norm = math.sqrt(space.dot(slots.G, slots.G))
        state.iteration += 1
        self._check_convergence(state, previous=previous)
        return state

    # -- the search direction: d = -H g by the two-loop recursion -----------------------

    def _direction(self, state: LbfgsState) -> float:
        """Leave d in D; returns the slope g.d."""
        space, slots = self.space, self.slots
        space.copy(slots.D, slots.G)
        alphas = []
        for slot, rho in reversed(state.history):
            alpha = rho * space.dot(slots.s(int(slot)), slots.D)
            space.axpy(slots.D, -alpha, slots.y(int(slot)))
            alphas.append(alpha)
        space.scale(slots.D, state.gamma)
        for (slot, rho), alpha in zip(state.history, reversed(alphas)):
            beta = rho * space.dot(slots.y(int(slot)), slots.D)
            space.axpy(slots.D, alpha - beta, slots.s(int(slot)))
        space.scale(slots.D, -1.0)
        return space.dot(slots.G, slots.D)

    def _steepest_descent(self) -> float:
        space, slots = self.space, self.slots
        space.copy(slots.D, slots.G)
        space.scale(slots.D, -1.0)
        return space.dot(slots.G, slots.D)

    # -- strong-Wolfe line search (bracketing, then zoom) -------------------------------

    def _line_search(self, state: LbfgsState, slope: float, step: float) -> float:
        """Find a step along D meeting the strong Wolfe conditions; XT and GT end at it."""
        f0 = state.objective
        assert f0 is not None, "iterate() starts from an evaluated state"
        budget = self.settings.max_line_search
        lo = (0.0, f0, slope)
        for trial in range(budget):
            f, d = self._evaluate_at(state, step)
            if f > f0 + C1 * step * slope or (trial > 0 and f >= lo[1]):
                return self._zoom(state, f0, slope, lo, (step, f, d), budget - trial - 1)
            if abs(d) <= -C2 * slope:
                return f
            if d >= 0:
                return self._zoom(state, f0, slope, (step, f, d), lo, budget - trial - 1)
            lo = (step, f, d)
            step *= STEP_GROWTH
        return self._settle(state, f0, lo, evaluated=lo[0])

    def _zoom(self, state: LbfgsState, f0: float, slope: float, lo: tuple, hi: tuple, budget: int) -> float:
        """Narrow [lo, hi] (lo: the best point meeting sufficient decrease) until a step
        meets the curvature condition too."""
        last = hi[0]
        for _ in range(budget):
            step = _interpolate(lo, hi)
            f, d = self._evaluate_at(state, step)
            last = step
            if f > f0 + C1 * step * slope or f >= lo[1]:
                hi = (step, f, d)
                continue
            if abs(d) <= -C2 * slope:
                return f
            if d * (hi[0] - lo[0]) >= 0:
                hi = lo
            lo = (step, f, d)
        return self._settle(state, f0, lo, evaluated=last)

    def _settle(self, state: LbfgsState, f0: float, lo: tuple, *, evaluated: float) -> float:
        """Out of evaluations: take the best decreasing step found, if there is one."""
        step, f, _ = lo
        if step <= 0 or f >= f0:
            raise errors.LineSearchFailed()
        if evaluated != step:
            f, _ = self._evaluate_at(state, step)
        return f

    def _evaluate_at(self, state: LbfgsState, step: float) -> tuple[float, float]:
        """(f, g.d) at X + step D."""
        space, slots = self.space, self.slots
        space.copy(slots.XT, slots.X)
        space.axpy(slots.XT, step, slots.D)
        f = space.evaluate()
        state.evaluations += 1
        if not math.isfinite(f):
            return math.inf, math.inf
        return f, space.dot(slots.GT, slots.D)

    # -- the history pair and the stopping tests ----------------------------------------

    def _remember_step(self, state: LbfgsState) -> None:
        """s = XT - X, y = GT - G into the next ring slot, if the pair has curvature."""
        space, slots = self.space, self.slots
        slot = state.next_slot
        s, y = slots.s(slot), slots.y(slot)
        space.copy(s, slots.XT)
        space.axpy(s, -1.0, slots.X)
        space.copy(y, slots.GT)
        space.axpy(y, -1.0, slots.G)
        sy, yy = space.dot(s, y), space.dot(y, y)
        if sy <= CURVATURE_EPS * yy or yy == 0:
            return
        state.history = [h for h in state.history if int(h[0]) != slot] + [[slot, 1.0 / sy]]
        state.history = state.history[-self.settings.history:]
        state.next_slot = (slot + 1) % self.settings.history
        state.gamma = sy / yy

    def _check_convergence(self, state: LbfgsState, previous: float | None) -> None:
        if state.gradient_norm <= self.settings.gradient_tolerance:
            state.converged = "GradientTolerance"
        elif previous is not None and state.objective is not None:
            decrease = (previous - state.objective) / max(abs(previous), abs(state.objective), 1.0)
            if decrease <= self.settings.objective_tolerance:
                state.converged = "ObjectiveTolerance"


def _interpolate(lo: tuple, hi: tuple) -> float:
    """The minimiser of the quadratic through f(lo), f'(lo) and f(hi), kept well inside
    the interval (bisection when the quadratic says nothing useful)."""
    (a, fa, da), (b, fb, _) = lo, hi
    width = b - a
    curvature = fb - fa - da * width
    step = a - da * width * width / (2 * curvature) if curvature > 0 else a + width / 2
    low, high = sorted((a + 0.1 * width, b - 0.1 * width))
    if not low <= step <= high or not math.isfinite(step):
        step = a + width / 2
    return step
