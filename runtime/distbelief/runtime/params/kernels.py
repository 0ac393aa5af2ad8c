"""The update rules' loops, compiled by numba: one pass per element, reading each operand
once and writing each result once (optim.py cuts a slice into parts and calls these).

Why numba: its wheels carry their own LLVM (llvmlite), so nothing is built on install
and the image needs no compiler; the loops release the GIL (nogil), so optim's threads
run their parts at once. fastmath stays off and every operation is float32, in the
order of the rule's formula, so the result is the IEEE float32 one numpy's ufuncs give.
error_model="numpy" drops the Python-style zero check before each division (the
divisor is never below epsilon), which lets LLVM vectorise the loop.

The kernels compile when this module is first imported, for the one signature they
serve (half a second, after numba's own import), or load from numba's cache: beside this file when its folder is
writable, else NUMBA_CACHE_DIR or the user's cache folder (the image sets
NUMBA_CACHE_DIR under /tmp). With no writable folder at all they compile at every start.
Only a shard imports this module: a worker never pays for importing numba.
"""

from __future__ import annotations

from typing import Callable

import numba
import numpy as np
from numba import types

VALUES = types.Array(types.float32, 1, "C")
READ_ONLY = types.Array(types.float32, 1, "C", readonly=True)  # a received gradient's frame
COMPILE = {"nogil": True, "fastmath": False, "error_model": "numpy"}


def compiled(signature: types.Signature) -> Callable[[Callable], Callable]:
    """A decorator: the loop compiled for signature alone (an array of another type is
    refused, never converted), cached when numba finds a writable folder for it."""
    def compile_(loop: Callable) -> Callable:
        try:
            return numba.njit(signature, cache=True, **COMPILE)(loop)
        except RuntimeError:  # numba found no writable folder for its cache
            return numba.njit(signature, **COMPILE)(loop)
    return compile_


@compiled(types.void(VALUES, READ_ONLY, types.float32))
def sgd(params: np.ndarray, grad: np.ndarray, learning_rate: np.float32) -> None:
    """params -= learning_rate * grad."""
    for i in range(params.size):
        params[i] -= grad[i] * learning_rate


@compiled(types.void(VALUES, READ_ONLY, VALUES, types.float32, types.float32))
def adagrad(params: np.ndarray, grad: np.ndarray, accumulator: np.ndarray, learning_rate: np.float32,
            epsilon: np.float32) -> None:
    """accumulator += grad^2; params -= learning_rate * grad / (sqrt(accumulator) + epsilon)."""
    for i in range(params.size):
        g = grad[i]
        a = accumulator[i] + g * g
        accumulator[i] = a
        params[i] -= g / (np.sqrt(a) + epsilon) * learning_rate
