"""The engine's random streams re-derived from their documented definition (engine/rng.py), for
the loop reference's ``randoms`` and ``shuffles`` hooks (tests/reference.py)."""

from __future__ import annotations

import numpy as np

from tl_geometry.engine.rng import GOLDEN, SAMPLE_STRIDE, SHUFFLE_SALT, mix, sequence_keys

SAMPLES = 3


def fisher_yates(keys: list[int], row_key: int, samples: int) -> list[list[int]]:
    """Full Fisher–Yates shuffles of ``keys`` from the documented stream (engine/rng.py); the
    engine's partial shuffles are prefixes of these."""
    out = []
    for sample in range(samples):
        perm = list(keys)
        m = len(perm)
        for r in range(m - 1):
            u = mix(row_key + GOLDEN * (sample * SAMPLE_STRIDE + r + 1))
            j = r + (((u >> 32) * (m - r)) >> 32)
            perm[r], perm[j] = perm[j], perm[r]
        out.append(perm)
    return out


def row_key(seed: int, layer: int, mask: np.ndarray | None, b: int, h: int, t: int, offset: int = 0) -> int:
    real_index = t if mask is None else int(mask[b, : t + 1].sum()) - 1
    return mix(mix(int(sequence_keys(seed, layer, [offset + b])[0]) + real_index) + h)


def engine_randoms(seed: int, layer: int, mask: np.ndarray | None, samples: int = SAMPLES):
    """The random subsets' orderings of the query's candidate keys (the reference's ``randoms``)."""
    return lambda b, h, t, keys: fisher_yates(keys, row_key(seed, layer, mask, b, h, t), samples)


def engine_shuffles(seed: int, layer: int, mask: np.ndarray | None, samples: int = SAMPLES):
    """The value-shuffle permutations of the non-sink candidates (the reference's ``shuffles``)."""
    return lambda b, h, t, listed: fisher_yates(
        listed, mix(row_key(seed, layer, mask, b, h, t) ^ SHUFFLE_SALT), samples)
