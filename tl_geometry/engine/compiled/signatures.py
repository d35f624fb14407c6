"""Every combination of argument types the engine calls the kernels with, to compile them at once.

numba compiles and caches a kernel once per combination of argument types, so a run that
reaches a new one (a float64 cache after a float32 one, the recompute path, a near tie in the
votes) compiles again. :func:`compile_all` compiles every combination of :data:`SIGNATURES` (or
loads it from the disk cache), so no later process compiles again. Every array is C-contiguous
(:mod:`..backend`); tests/engine/test_first_run.py checks that the engine's calls are exactly these.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from numba import types

from ..layout import ScoreChunk, ScoreOutputs, ScoreSettings
from . import check, geometry, reduce, score, vote

#: The precisions of the attention rows (float32: a cached pattern, narrower ones upcast;
#: float64: a float64 pattern or recomputed rows), of the value vectors the scores read (float32
#: where that is exact, :func:`..backend._score_vectors`) and of queries and keys (:mod:`..key_votes`).
PRECISIONS = (types.float32, types.float64)

#: Scalars and array elements: numba types a Python int, float and bool as these.
_I, _F, _B = types.int64, types.float64, types.boolean


def _a(dtype: Any, ndim: int) -> types.Array:
    """A C-contiguous, writable array type."""
    return types.Array(dtype, ndim, "C")


def _record(cls: type[NamedTuple], **fields: Any) -> types.BaseTuple:
    """The type :func:`numba.typeof` gives a record ``cls`` (a named tuple of :mod:`..layout`)
    whose fields, named in the order of ``cls._fields``, have these types."""
    if tuple(fields) != cls._fields:
        raise ValueError(f"{cls.__name__} has the fields {cls._fields}, not {tuple(fields)}")
    return types.BaseTuple.from_types(tuple(fields.values()), cls)


def _signatures() -> list[tuple[str, tuple[Any, ...]]]:
    """``(kernel, argument types)`` of every call of :mod:`..backend` and :mod:`..key_votes`."""
    stats, vote_of = _a(_F, 3), _a(types.int8, 3)
    found: list[tuple[str, tuple[Any, ...]]] = [
        ("check.check_and_vote_rows", (_a(_F, 4), _a(_I, 2), _a(_B, 3), _a(_B, 2), _a(_I, 1), _a(_F, 3), _I, _I,
                                       stats, vote_of)),
        ("geometry.sink_geometry", (_a(_F, 4), _a(_B, 2), _a(_I, 1), _a(_I, 2), _I, _I, _a(_F, 4), _I)),
        ("geometry.tie_duplicates", (_a(_F, 4), _a(_F, 4), _I)),
        ("reduce.reduce_rows", (_a(_F, 6), _a(_B, 4), _a(_F, 4), _a(_B, 2), _I, _I, _I, _a(_F, 5), _a(_F, 4),
                                _a(_F, 3), _a(_F, 3), _a(_F, 2), _a(_F, 3))),
        ("reduce.tally", (vote_of, _a(_B, 2), _a(_I, 1), _a(_I, 1), _I, _I, _a(_I, 3), _a(_I, 3), _a(_I, 4))),
    ]
    settings = _record(ScoreSettings, n_values=_a(_I, 1), samples=_I, shuffles=_I, shuffle_kind=_I,
                       by_contribution=_B, cosine=_B)
    outputs = _record(ScoreOutputs, metrics=_a(_F, 6), sink_in_top=_a(_B, 4), sink_fields=_a(_F, 4),
                      random_var=_a(_F, 5))
    for rows in PRECISIONS:
        for vectors in PRECISIONS:
            chunk = _record(ScoreChunk, rows=_a(rows, 4), row_of=_a(_I, 2), h0=_I, group_size=_I, g0=_I,
                            queries=_a(_I, 2), is_token=_a(_B, 2), start=_a(_I, 1), sink=_a(_I, 1), window=_I,
                            real_index=_a(_I, 2), sequence_keys=_a(_I, 1), gram=_a(_F, 4), values=_a(vectors, 4))
            found.append(("score.score_rows", (chunk, settings, outputs)))
    for dtype in PRECISIONS:  # of the rows, or of the queries and keys
        found += [
            ("check.check_and_vote", (_a(dtype, 4), _I, _a(_B, 2), _a(_I, 1), _a(_F, 3), _I, _I, stats,
                                      vote_of, _a(_I, 1), _a(_I, 1), _a(_I, 1), _a(_F, 3))),
            ("vote.vote_from_keys", (_a(dtype, 4), _a(dtype, 4), _F, _a(_B, 2), _a(_I, 1), _a(_F, 3), _a(_F, 2),
                                     _a(_F, 2), _I, _I, _I, _F, vote_of, _a(_B, 3))),
            ("vote.vote_from_logits", (_a(dtype, 3), _I, _I, _a(dtype, 3), _F, _a(_B, 1), _I, _a(_F, 2), _a(_F, 1),
                                       _a(_F, 1), _I, _I, _I, _F, _a(types.int8, 2), _a(_B, 2))),
        ]
    return found


#: ``(kernel, argument types)`` of every specialisation the engine calls; ``kernel`` is
#: ``module.function`` in this package.
SIGNATURES: tuple[tuple[str, tuple[Any, ...]], ...] = tuple(_signatures())

_MODULES = {"check": check, "geometry": geometry, "reduce": reduce, "score": score, "vote": vote}

#: The dispatchers by name, taken when this module is imported (a test that replaces a kernel
#: in its module does not replace it here).
KERNELS: dict[str, Any] = {name: getattr(_MODULES[name.partition(".")[0]], name.partition(".")[2])
                           for name, _ in SIGNATURES}


def compile_all() -> None:
    """Compile every specialisation of :data:`SIGNATURES`, or load it from numba's disk cache
    where a previous process compiled it (milliseconds each)."""
    for name, signature in SIGNATURES:
        KERNELS[name].compile(signature)


class StaleKernelsError(RuntimeError):
    """numba's disk cache holds kernels compiled with other result slots (:func:`check_slots`)."""


def check_slots() -> None:
    """Refuse cached kernels that write their figures to other slots than
    :data:`tl_geometry.functional.figures.FIGURES` gives: numba keys its disk cache on a kernel's
    own source file, so a changed table alone would leave the old slots compiled in."""
    stale = [module.__name__ for module in (score, geometry) if module.compiled_slots() != module.SLOTS]
    if stale:
        raise StaleKernelsError(
            f"the cached kernels of {', '.join(stale)} write to other result slots than "
            "tl_geometry.functional.figures gives (they were compiled before the table changed). "
            "Delete numba's cached kernels of tl_geometry/engine/compiled (the *.nbi and *.nbc files "
            "in its __pycache__, or under $NUMBA_CACHE_DIR or ~/.cache/numba) and run again.")
