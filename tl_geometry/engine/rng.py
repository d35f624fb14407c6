"""Counter-based random draws for the random baseline (SPEC §3), identical on every backend.

Every draw is a pure function of ``(seed, layer, sequence, query, head, sample, step)`` through
the SplitMix64 finaliser (sequences numbered globally, queries by their index among real tokens),
so no batching, padding, thread count or device moves it; :mod:`.compiled.order` and
:mod:`.twins.order` share the 64-bit wrap-around arithmetic bit for bit.

The size-``N`` random subsets are the first ``N`` keys of a partial Fisher–Yates shuffle of the
query's valid keys (in position order); the swap index of step ``r`` over ``m`` keys is
``r + ⌊(u >> 32)·(m − r) / 2³²⌋``, whose bias is below ``m / 2³²`` (ours). The nulls (SPEC §3)
draw a full Fisher–Yates shuffle of the non-sink valid keys from the row key mixed with
:data:`SHUFFLE_SALT` (ours); the unselected null gives the non-sink keys outside the top-N set,
in position order, the values of those keys in that permutation's order (ours).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from torch import Tensor

_M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15
#: The SplitMix64 finaliser's two multipliers (:func:`mix`).
MIX_C1 = 0xBF58476D1CE4E5B9
MIX_C2 = 0x94D049BB133111EB
#: ``step`` counts draws within one sample; samples are spaced this far apart.
SAMPLE_STRIDE = 1 << 32
#: XORed into a row's key (then mixed) for the value-shuffle permutations.
SHUFFLE_SALT = 0x5AFE_5EED_0F_5A_1E


def mix(z: int) -> int:
    """SplitMix64 finaliser of a Python int, modulo 2⁶⁴."""
    z &= _M64
    z = ((z ^ (z >> 30)) * MIX_C1) & _M64
    z = ((z ^ (z >> 27)) * MIX_C2) & _M64
    return z ^ (z >> 31)


def sequence_keys(seed: int, layer: int, sequences: Iterable[int]) -> np.ndarray:
    """``mix(mix(mix(seed) + layer) + sequence)`` for each global sequence index (``uint64``)."""
    base = mix(mix(seed) + layer)
    return np.array([mix(base + int(s)) for s in sequences], dtype=np.uint64)


#: Mixed with the seed for the sampled query positions (``queries=k``), a stream of its own.
QUERY_SALT = 0x0_5A3F_1E5_D0_9E7


def sampled_positions(seed: int, sequence: int, n_real: int, k: int) -> np.ndarray:
    """``queries=k`` (ours): ``k`` of a sequence's ``n_real`` real positions (all where
    ``n_real ≤ k``), sorted, drawn from a generator seeded by ``(seed, sequence)`` alone.

    >>> sampled_positions(0, 3, 10, 4).tolist() == sampled_positions(0, 3, 10, 4).tolist()
    True
    """
    if n_real <= k:
        return np.arange(n_real)
    generator = np.random.default_rng([seed & _M64, QUERY_SALT, sequence])  # any int seed, as mix() takes it
    return np.sort(generator.choice(n_real, size=k, replace=False))


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _shr(z: Tensor, s: int) -> Tensor:
    # Logical shift of int64 bits: torch's >> is arithmetic.
    return (z >> s) & ((1 << (64 - s)) - 1)


def torch_mix(z: Tensor) -> Tensor:
    """:func:`mix` on int64 tensors holding uint64 bits (wrap-around arithmetic)."""
    z = (z ^ _shr(z, 30)) * _signed(MIX_C1)
    z = (z ^ _shr(z, 27)) * _signed(MIX_C2)
    return z ^ _shr(z, 31)


def torch_swap_index(
    row_key: Tensor, sample: Tensor, step: int, n_keys: Tensor
) -> Tensor:
    """Fisher–Yates swap index of ``step`` for each row: in ``[step, n_keys)``."""
    u = torch_mix(row_key + _signed(GOLDEN) * (sample * SAMPLE_STRIDE + step + 1))
    return step + ((_shr(u, 32) * (n_keys - step)) >> 32)
