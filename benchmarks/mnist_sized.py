"""An MNIST-sized data set made from real handwriting, with no download.

No copy of MNIST is installed here, so time to accuracy runs on the handwritten digits that
scikit-learn bundles (1,797 images of 8x8), each upscaled 3x to 24x24 and placed at a random
offset in a 28x28 frame, with a little pixel noise: 70,000 examples of 784 features and 10
classes, the shape of MNIST. The held-out part is made from source images the training part
never saw (a tenth of them), so held-out accuracy measures generalisation to new writing,
not to new offsets of the same image. It lands where the runtime's split of an npz source
(testFraction TEST_FRACTION, seed 0) puts its held-out examples.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from distbelief.runtime.model import data

SAMPLES = 70_000
TEST_FRACTION = 1 / 7
HELD_OUT = 10_000  # round(SAMPLES * TEST_FRACTION), as MNIST
PATH = Path(__file__).resolve().parent.parent / "out" / "bench-data" / "mnist-sized-v1.npz"  # v2 when build() changes
SIDE, SCALE = 28, 3
SOURCE = {"source": "builtin:digits"}


def place(images: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """8x8 images upscaled, each at a random offset in the frame, with noise; flattened."""
    n = len(images)
    big = np.kron(images.reshape(n, 8, 8), np.ones((SCALE, SCALE), np.float32))
    room = SIDE - 8 * SCALE
    out = np.zeros((n, SIDE, SIDE), np.float32)
    dy, dx = rng.integers(0, room + 1, n), rng.integers(0, room + 1, n)
    for oy in range(room + 1):
        for ox in range(room + 1):
            sel = (dy == oy) & (dx == ox)
            out[sel, oy:oy + 8 * SCALE, ox:ox + 8 * SCALE] = big[sel]
    out += rng.normal(0.0, 0.05, out.shape).astype(np.float32)
    return out.reshape(n, SIDE * SIDE)


def build(samples: int = SAMPLES, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x, y, the source image of every example), held-out examples where data.split puts them."""
    rng = np.random.default_rng(seed)
    x_src, y_src = data.load_source(SOURCE["source"])
    index = np.arange(len(x_src))
    held = rng.permutation(len(x_src)) < len(x_src) // 10
    n_test = max(1, int(round(samples * TEST_FRACTION)))
    order = np.random.default_rng(0).permutation(samples)  # what data.split(seed=0) draws
    x, y = np.empty((samples, SIDE * SIDE), np.float32), np.empty(samples, np.int64)
    source = np.empty(samples, np.int64)
    for rows, part in ((order[:n_test], held), (order[n_test:], ~held)):
        pick = rng.integers(0, part.sum(), len(rows))
        x[rows], y[rows], source[rows] = place(x_src[part][pick], rng), y_src[part][pick], index[part][pick]
    return x, y, source


def make(path: Path = PATH, seed: int = 0) -> Path:
    """Write the set to path (an npz with x and y) unless it is there already."""
    if path.exists():
        return path
    x, y, _ = build(SAMPLES, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, x=x, y=y)
    tmp.rename(path)
    return path
