"""bfloat16 on the wire (spec.parameterServers.wireFormat: bfloat16): float32 arrays
narrowed to half their bytes for the trip, widened back on arrival.

numpy has no bfloat16 dtype: a bfloat16 is the high 16 bits of a float32 (same sign and
8-bit exponent, 7 of the 23 mantissa bits), carried as uint16 (WIRE_DTYPE). Narrowing
rounds to nearest, ties to even, by adding 0x7FFF plus the lowest kept bit to the
float32's bits before dropping the low 16; finite values past the largest bfloat16 become
inf, as IEEE rounding says, and a NaN stays a (quiet) NaN. Widening is exact: the 16 bits
become the high half of a float32. The relative error of one narrowing is at most 2^-8.

Both work over cache-sized blocks (BLOCK) with one preallocated scratch block, so a
conversion costs no temporary as large as the model.
"""

from __future__ import annotations

import numpy as np

from distbelief.runtime.wire.protocol import BFLOAT16 as WIRE_DTYPE

BLOCK = 64 * 1024  # values per block: 256 KiB of float32, a block and its scratch stay in L2
_ROUNDING_BIAS = np.uint32(0x7FFF)
_QUIET_BIT = np.uint32(0x0040)  # the highest mantissa bit of a bfloat16: set, a NaN stays NaN


class Codec:
    """Narrows float32 arrays to bfloat16 and widens them back, in blocks."""

    def __init__(self, size: int = BLOCK) -> None:
        """size: the longest array it will narrow (its scratch is no longer than that)."""
        self._scratch = np.empty(min(BLOCK, max(size, 1)), dtype=np.uint32)
        self._nan = np.empty(self._scratch.size, dtype=bool)

    def narrow(self, values: np.ndarray, out: np.ndarray) -> np.ndarray:
        """values (float32) rounded to bfloat16 into out (uint16, as many values); returns out.

        out may be the first half of values' own memory (values.view(WIRE_DTYPE)[:n]):
        each block is read whole before its result is written, and results land no
        further than the block just read."""
        if values.dtype != np.float32 or out.dtype != WIRE_DTYPE or values.size != out.size:
            raise ValueError(f"narrow takes float32 into as many uint16 values (got {values.dtype} "
                             f"[{values.size}] into {out.dtype} [{out.size}])")
        bits, block = values.view(np.uint32), self._scratch.size
        for start in range(0, values.size, block):
            stop = min(start + block, values.size)
            self._round_block(values[start:stop], bits[start:stop], self._scratch[: stop - start])
            out[start:stop] = self._scratch[: stop - start]  # the high halves, now rounded
        return out

    def _round_block(self, values: np.ndarray, bits: np.ndarray, rounded: np.ndarray) -> None:
        np.right_shift(bits, 16, out=rounded)
        rounded &= 1                # the lowest bit kept: ties go to the even neighbour
        rounded += _ROUNDING_BIAS
        rounded += bits             # a NaN's carry may wrap: fixed below
        rounded >>= 16
        nan = np.isnan(values, out=self._nan[: values.size])
        if nan.any():
            np.copyto(rounded, (bits >> 16) | _QUIET_BIT, where=nan)

    @staticmethod
    def widen(wire: np.ndarray, out: np.ndarray) -> np.ndarray:
        """wire (bfloat16 as uint16) into out (float32, as many values), exactly; returns out."""
        if wire.dtype != WIRE_DTYPE or out.dtype != np.float32 or wire.size != out.size:
            raise ValueError(f"widen takes uint16 into as many float32 values (got {wire.dtype} "
                             f"[{wire.size}] into {out.dtype} [{out.size}])")
        bits = out.view(np.uint32)
        for start in range(0, wire.size, BLOCK):
            stop = min(start + BLOCK, wire.size)
            np.left_shift(wire[start:stop], 16, out=bits[start:stop], dtype=np.uint32)
        return out
