"""The analysis options, their defaults and their validation: one source for every front-end."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, TypedDict, TypeGuard, get_args

import numpy as np
import torch
from torch import Tensor

from ..result.schema import SHUFFLE_KINDS, ShuffleKind
from ..warn import warn_caller

QueryRule = Literal["last", "all"]
#: ``"last"`` (the paper's protocol), ``"all"``, an int ``k`` (a seeded sample of ``k`` real
#: positions per sequence) or explicit positions (counted from each sequence's first real token).
Queries = QueryRule | int | Sequence[int]
Distance = Literal["euclidean", "cosine"]
Space = Literal["value", "output"]
RankBy = Literal["attention", "contribution"]
BackendName = Literal["auto", "numba", "torch"]


class AnalysisArgs(TypedDict, total=False):
    """The analysis options the front-ends take as keywords (``**options:
    Unpack[AnalysisArgs]``), validated by :func:`check_options`; meanings: ``analyze_heads``."""

    n_values: Sequence[int]
    queries: Queries
    random_samples: int
    shuffle_samples: int
    shuffle: ShuffleKind
    seed: int
    distance: Distance
    space: Space
    rank_by: RankBy
    bounds: bool
    backend: BackendName
    per_window: bool


#: Every option's name, in :class:`AnalysisArgs`' order.
OPTION_NAMES: tuple[str, ...] = tuple(AnalysisArgs.__annotations__)

#: The selection sizes ``N`` that an analysis scores by default.
DEFAULT_N_VALUES = (1, 2, 4, 8, 16, 32, 64)
#: ``R``, the permutations of the random baseline and of every null per (query, head) (SPEC §3,
#: decided 2026-12-05): 16 where one query per sequence is evaluated (the last), 4 where more are
#: (all, or a sample of positions: a head's mean already averages over many queries).
DEFAULT_RANDOM_SAMPLES = 16
DEFAULT_RANDOM_SAMPLES_MANY = 4
DEFAULT_SHUFFLE_SAMPLES = DEFAULT_RANDOM_SAMPLES
#: The most positions ``queries=`` may sample or name per sequence.
MAX_QUERIES = 1 << 20
#: The null of the ``shuffled`` group (SPEC §3): the non-sink values permuted.
DEFAULT_SHUFFLE: ShuffleKind = "values"
#: How the kernels number the nulls: their positions in :data:`SHUFFLE_KINDS`.
NULL_VALUES, NULL_NORMS, NULL_DIRECTIONS, NULL_UNSELECTED = (
    SHUFFLE_KINDS.index(kind) for kind in ("values", "norms", "directions", "unselected"))
#: Largest selection size accepted: sizes beyond any real context are a typo, not a request.
MAX_N = 1 << 31
#: The window the kernels read for a layer without one: larger than any position, so
#: ``max(start, t − NO_WINDOW + 1)`` is the first real key.
NO_WINDOW = 1 << 62


@dataclass(frozen=True)
class AnalysisOptions:
    """Validated options that every layer of one analysis shares."""

    n_values: Tensor
    queries: QueryRule | int | tuple[int, ...] = "last"
    random_samples: int = DEFAULT_RANDOM_SAMPLES
    shuffle_samples: int = DEFAULT_SHUFFLE_SAMPLES
    shuffle: ShuffleKind = DEFAULT_SHUFFLE
    seed: int = 0
    distance: Distance = "euclidean"
    space: Space = "value"
    rank_by: RankBy = "attention"
    bounds: bool = False
    backend: BackendName = "auto"
    per_window: bool = False


def _is_int(x: object) -> TypeGuard[int | np.integer]:
    """An int or NumPy integer, not a bool."""
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _choice(name: str, value: object, literal: object, notes: dict[str, str] | None = None) -> None:
    """``value`` must be one of the ``Literal``'s choices: "x must be 'a' (note) or 'b', got …"."""
    choices = get_args(literal)
    if not isinstance(value, str) or value not in choices:
        named = [repr(c) + (f" ({notes[c]})" if notes and c in notes else "") for c in choices]
        listed = ", ".join(named[:-1]) + " or " + named[-1]
        raise ValueError(f"{name} must be {listed}, got {value!r}.")


_SHUFFLE_NOTES = {
    "values": "the default: non-sink values permuted",
    "norms": "each key keeps its direction, takes a permuted norm",
    "directions": "each key keeps its norm, takes a permuted direction",
    "unselected": "only the values outside the top-N set permuted",
}


def default_samples(queries: object) -> int:
    """SPEC §3's ``R``: 16 where one query per sequence is evaluated, 4 where more are."""
    one = queries == "last" or queries == 1 or (isinstance(queries, tuple) and len(queries) == 1)
    return DEFAULT_RANDOM_SAMPLES if one else DEFAULT_RANDOM_SAMPLES_MANY


def check_queries(queries: object) -> QueryRule | int | tuple[int, ...]:
    """``queries=``: ``"last"``, ``"all"``, a sample size ``k ≥ 1`` or positions ``≥ 0`` (counted
    from each sequence's first real token; sorted, each once)."""
    how = ("queries must be 'last' (paper protocol), 'all', an int k ≥ 1 (a seeded sample of k "
           "positions per sequence) or a list of positions ≥ 0 (from each sequence's first token)")
    if isinstance(queries, str):
        if queries not in get_args(QueryRule):
            raise ValueError(f"{how}; got {queries!r}.")
        return queries  # type: ignore[return-value]
    if _is_int(queries):
        if not 1 <= queries <= MAX_QUERIES:
            raise ValueError(f"{how}; got {queries} (at most {MAX_QUERIES}).")
        return int(queries)
    if isinstance(queries, Tensor):
        queries = queries.tolist()
    if isinstance(queries, (Sequence, np.ndarray)) and not isinstance(queries, (bytes, bytearray)):
        values = list(queries)
        if not values or len(values) > MAX_QUERIES or any(not _is_int(x) or x < 0 for x in values):
            raise ValueError(f"{how}; got {values[:8]!r}{' …' if len(values) > 8 else ''}.")
        if len(set(values)) != len(values):
            raise ValueError(f"queries names a position twice: {sorted(values)[:8]}; give each once.")
        return tuple(sorted(int(x) for x in values))
    raise ValueError(f"{how}; got a {type(queries).__name__}.")


def check_query_positions(queries: QueryRule | int | tuple[int, ...], lengths: Sequence[int] | Tensor) -> None:
    """Warn, before any forward, of given positions (``queries=[...]``) that no window holds
    (``lengths``: each window's real tokens): they are never read (all of them: NaN figures)."""
    if not isinstance(queries, tuple):
        return
    sizes = {int(x) for x in lengths}
    longest = max(sizes, default=0)
    outside = [p for p in queries if p >= longest]
    if not outside:
        return
    where = (f"every window holds {longest} real tokens" if len(sizes) == 1
             else f"the longest window holds {longest} real tokens")
    shown = f"{list(outside[:8])}{' …' if len(outside) > 8 else ''}"
    if len(outside) == len(queries):
        warn_caller(f"queries names positions {shown} but {where} (positions count from each window's first "
                    f"real token): no query is read, and every per-query figure (P/R/F, the baselines, the "
                    f"sink diagnostics) is NaN. Pass positions below {longest}, or longer windows.")
    else:
        warn_caller(f"queries positions {shown} lie past every window ({where}; positions count from each "
                    f"window's first real token): they are not read. Pass positions below {longest}.")


def n_chosen(queries: QueryRule | int | tuple[int, ...], n_pos: int) -> int:
    """Chosen queries per sequence (the width of the per-query rows)."""
    if queries == "last":
        return 1
    if queries == "all":
        return n_pos
    return min(queries, n_pos) if isinstance(queries, int) else len(queries)


def _flag(name: str, value: object) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{name} must be True or False, got {value!r}.")
    return bool(value)


def _count(name: str, value: object, what: str) -> int:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (0 turns {what} off), got {value!r}.")
    return int(value)


def n_value_tensor(n_values: object) -> Tensor:
    """Sorted selection sizes as an int64 tensor; a clear ``ValueError`` for anything else."""
    if isinstance(n_values, (Tensor, np.ndarray)):
        n_values = n_values.tolist()
    if _is_int(n_values):
        values = [n_values]
    elif isinstance(n_values, (str, bytes)) or not isinstance(n_values, (Sequence, range, tuple, list)):
        raise ValueError(f"n_values must be a sequence of positive ints, got {n_values!r}.")
    else:
        values = list(n_values)
    if not values or any(not _is_int(n) or not 1 <= n <= MAX_N for n in values):
        raise ValueError(
            f"n_values must be positive ints (selection sizes 1 ≤ N ≤ 2**31), got {n_values!r}."
        )
    values = [int(n) for n in values]
    if len(set(values)) != len(values):
        raise ValueError(f"n_values has duplicates: {values}; give each N once.")
    return torch.tensor(sorted(values), dtype=torch.int64)


def check_option_names(options: Mapping[str, object], caller: str, refused: Sequence[str] = ()) -> None:
    """A ``TypeError`` naming ``caller`` and the accepted options for a keyword that is not an
    analysis option (or one of ``refused``, which ``caller`` sets itself)."""
    unknown = [name for name in options if name not in OPTION_NAMES or name in refused]
    if unknown:
        accepted = [name for name in OPTION_NAMES if name not in refused]
        raise TypeError(f"{caller}() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}; "
                        f"its analysis options are {', '.join(accepted)}.")


def check_options(
    *,
    n_values: object = DEFAULT_N_VALUES,
    queries: object = "last",
    random_samples: object = None,
    shuffle_samples: object = None,
    shuffle: object = DEFAULT_SHUFFLE,
    seed: object = 0,
    distance: object = "euclidean",
    space: object = "value",
    rank_by: object = "attention",
    bounds: object = False,
    backend: object = "auto",
    per_window: object = False,
) -> AnalysisOptions:
    """Validate every option at once, before any tensor is read; ``ValueError`` names the fix.
    ``random_samples`` and ``shuffle_samples`` default to SPEC §3's ``R`` (:func:`default_samples`).

    >>> check_options(queries="all").random_samples
    4
    """
    queries = check_queries(queries)
    r = default_samples(queries)
    samples = _count("random_samples", r if random_samples is None else random_samples, "the random baseline")
    # Every null uses the baseline's R (SPEC §3), and the default R where the baseline is off.
    shuffles = _count("shuffle_samples", (samples or r) if shuffle_samples is None else shuffle_samples,
                      "the value-shuffle null")
    _choice("distance", distance, Distance)
    _choice("space", space, Space, {"value": "α·v", "output": "α·v·W_O"})
    _choice("rank_by", rank_by, RankBy)
    _choice("backend", backend, BackendName)
    _choice("shuffle", shuffle, ShuffleKind, _SHUFFLE_NOTES)
    bounds = _flag("bounds", bounds)
    if bounds and distance != "euclidean":
        raise ValueError("bounds=True needs distance='euclidean': the bounds are Euclidean "
                         "(docs/math.md, bounds).")
    if not _is_int(seed):
        raise ValueError(f"seed must be an int, got {seed!r}.")
    return AnalysisOptions(
        n_values=n_value_tensor(n_values), queries=queries, random_samples=samples,
        shuffle_samples=shuffles, shuffle=shuffle,  # type: ignore[arg-type]
        seed=int(seed), distance=distance, space=space, rank_by=rank_by,  # type: ignore[arg-type]
        bounds=bounds, backend=backend,  # type: ignore[arg-type]
        per_window=_flag("per_window", per_window),
    )


def _window_entry(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or not 1 <= value < NO_WINDOW:
        raise ValueError(f"{name} must be a positive int (keys t − w < i ≤ t are visible) or None "
                         f"(a global layer), got {value!r}.")
    return int(value)


def check_window(window: object) -> None:
    """Validate a ``window=`` option (:func:`layer_windows`) before any tensor is read."""
    layer_windows(window, [])


def layer_windows(window: object, layers: Sequence[int]) -> tuple[int | None, ...]:
    """The sliding window of each analysed layer (SPEC §1, ours), ``None`` for a global one, from
    ``None``, one int for every layer, a sequence indexed by model layer (covering every analysed
    layer) or a mapping ``{layer: window}`` (a layer it does not name is global).

    >>> layer_windows({1: 4}, [0, 1])
    (None, 4)
    >>> layer_windows([None, 512, None], [1, 2])
    (512, None)
    """
    if window is None or isinstance(window, (int, np.integer)):
        every = _window_entry("window", window)
        return tuple(every for _ in layers)
    if isinstance(window, Mapping):
        for layer, w in window.items():
            if not _is_int(layer) or layer < 0:
                raise ValueError(f"window keys must be model layer indices (ints ≥ 0), got {layer!r}.")
            _window_entry(f"window[{layer}]", w)
        return tuple(_window_entry(f"window[{layer}]", window.get(layer)) for layer in layers)
    if not isinstance(window, Sequence) or isinstance(window, (str, bytes)):
        raise ValueError("window must be None, a positive int, a sequence with one entry per model "
                         "layer or a dict {layer: window} (entries None for global layers), got "
                         f"{window!r}.")
    per_layer = list(window)
    for layer, w in enumerate(per_layer):
        _window_entry(f"window[{layer}]", w)
    short = [layer for layer in layers if layer >= len(per_layer)]
    if short:
        raise ValueError(f"window has {len(per_layer)} entries (one per model layer) but layers "
                         f"{short} are analysed: give one entry per layer, or a dict {{layer: window}}.")
    return tuple(per_layer[layer] for layer in layers)
