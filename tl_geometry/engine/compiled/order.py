"""Compiled selection orders of the scoring kernel (numba, CPU): the stable ranking of the keys
(SPEC §2) and the seeded permutations of the random baseline and the value-shuffle null
(the counter-based stream of :mod:`..rng`, bit for bit). Compiled on first use and cached on disk.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from ..rng import GOLDEN, MIX_C1, MIX_C2, SAMPLE_STRIDE, SHUFFLE_SALT

_U_C1, _U_C2, _U_GOLDEN, _U_STRIDE = (np.uint64(x) for x in (MIX_C1, MIX_C2, GOLDEN, SAMPLE_STRIDE))
SHUFFLE_SALT_U64 = np.uint64(SHUFFLE_SALT)
_S27, _S30, _S31, _S32 = np.uint64(27), np.uint64(30), np.uint64(31), np.uint64(32)
_U_SIGN, _U_LOW = np.uint64(0x80000000), np.uint64(0xFFFFFFFF)


@njit(cache=True, inline="always")
def mix(z):  # pragma: no cover - compiled
    """The SplitMix64 finaliser of a uint64: :func:`..rng.mix`, compiled."""
    z = (z ^ (z >> _S30)) * _U_C1
    z = (z ^ (z >> _S27)) * _U_C2
    return z ^ (z >> _S31)


@njit(cache=True)
def fisher_yates(perm, steps, row_key, sample):  # pragma: no cover - compiled
    """The first ``steps`` swaps of the Fisher–Yates shuffle of ``perm`` (stream of :mod:`..rng`)."""
    m = perm.shape[0]
    base = np.uint64(sample) * _U_STRIDE
    for r in range(steps):
        u = mix(row_key + _U_GOLDEN * (base + np.uint64(r + 1)))
        j = r + np.int64(((u >> _S32) * np.uint64(m - r)) >> _S32)
        perm[r], perm[j] = perm[j], perm[r]


@njit(cache=True)
def rank_keys(keys, score, single, packed, out):  # pragma: no cover - compiled
    """``out[:m]`` = ``keys`` by ascending ``score``, ties to the lower key: a stable argsort
    (SPEC §2). ``single`` (float32) and ``packed`` (uint64) are scratch of at least ``m``. When
    every score is a float32 (weights from a float32 or narrower pattern), one sort of the distinct
    words ``(order bits of the float32) << 32 | position`` replaces the merge sort."""
    m = keys.shape[0]
    for j in range(m):
        x = score[j] + 0.0  # −0 → +0: equal scores must tie
        single[j] = np.float32(x)
        if np.float64(single[j]) != x:
            out[:m] = keys[np.argsort(score, kind="mergesort")]
            return
    bits32 = single.view(np.uint32)
    for j in range(m):
        bits = np.uint64(bits32[j])
        # IEEE order bits: set the sign bit of a positive float, flip every bit of a negative.
        bits = bits ^ _U_SIGN if bits < _U_SIGN else bits ^ _U_LOW
        packed[j] = (bits << _S32) | np.uint64(j)
    words = packed[:m]
    words.sort()
    for j in range(m):
        out[j] = keys[np.int64(words[j] & _U_LOW)]
