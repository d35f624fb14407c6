"""Verdicts with uncertainty (SPEC §8, ours): a seeded bootstrap over windows, its BCa 95 %
interval, and the three-outcome reading of a threshold rule on it.

* :func:`bootstrap` resamples the units (windows; with fewer than 8 windows, 128-query blocks from
  :func:`blocks`, SPEC §5) with replacement, :data:`RESAMPLES` times from one seed, and recomputes
  the statistic on every resample. The statistic receives the drawn unit indices, so a statistic
  over heads keeps the heads fixed and recomputes everything per resample (votes and labels too).
  The interval is the bias-corrected and accelerated one (:func:`bca`, SPEC §8 since 2026-12-06:
  the acceleration from the jackknife over the units), as ``scipy.stats.bootstrap(method="BCa")``
  computes it from the same draws; a percentile interval of a skewed statistic can exclude its
  own point estimate.
* :func:`decide` reads a rule "``low ≤ x ≤ high``": **held** where the whole interval satisfies it,
  **not held** where none of it does, **undecided** otherwise, **too few** below
  :data:`MIN_UNITS` units (no verdict, the page prints n).
* :func:`categorize` reads a rule with several categories (lowers / no effect / raises): each is
  decided on its own interval rule; an interval that reaches into two names both.
* :func:`combine` turns the per-run outcomes of a claim's checks into the claim's verdict.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import Tensor

from tl_geometry.result.schema import WINDOW_GROUPS, names

from .document import HELD, NOT_HELD, PARTLY
from .rules import verdict

RESAMPLES = 1000  # SPEC §8
LEVEL = 0.95
MIN_UNITS = 8  # below it a statistic gets no verdict (SPEC §8, "too few")
BLOCK = 128  # queries per block when windows are too few (SPEC §5)
SEED = 0
UNDECIDED, TOO_FEW = "undecided", "too few"
#: A thresholded number whose per-window values the saved results do not hold: no interval, so
#: (SPEC §8) no verdict either; printed as such, never decided on the point value.
NO_INTERVAL = "no interval"
#: A sink claim of a model whose sink check found a weak sink (SPEC §1: the sink is not the most
#: attended of the first 32 keys in most layers): reported as "no sink", never decided.
NO_SINK = "no sink"
#: A claim whose study was not run for a model (the ablation and capacity studies of an opt-in
#: model): no verdict, and no level for the size section's direction.
NOT_MEASURED = "not measured"
#: Outcomes that carry no verdict: left out when a claim's checks are combined.
MISSING = (TOO_FEW, NO_INTERVAL, NO_SINK, NOT_MEASURED)

#: The value-shuffle null's reading (SPEC §3): F∗(top) − F∗(shuffled) against ±0.05.
GEOMETRY = (("lowers", -math.inf, -0.05), ("no effect", -0.05, 0.05), ("raises", 0.05, math.inf))


@dataclass(frozen=True)
class Interval:
    """A statistic, its BCa interval over the resamples and the number of units behind it (NaN
    ends when the units are too few or the resamples do not define it)."""

    value: float
    low: float
    high: float
    n: int

    @property
    def too_few(self) -> bool:
        return self.n < MIN_UNITS

    def show(self, digits: int = 3, percent: bool = False) -> str:
        """``0.123 [0.100, 0.150]``; ``0.123 (n = 4, too few)`` below :data:`MIN_UNITS` units."""
        scale, unit = (100, " %") if percent else (1, "")
        if math.isnan(self.value):
            return "–"
        value = f"{scale * self.value:.{digits}f}{unit}"
        if self.too_few:
            return f"{value} (n = {self.n}, {TOO_FEW})"
        if math.isnan(self.low):
            return f"{value} [–]"
        return f"{value} [{scale * self.low:.{digits}f}, {scale * self.high:.{digits}f}]"


def draws(n_units: int, resamples: int = RESAMPLES, seed: int = SEED) -> Tensor:
    """``[resamples, n_units]`` unit indices drawn with replacement from their own generator, so
    the same seed gives the same draws whatever else ran before."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, n_units, (resamples, n_units), generator=generator)


def bootstrap(statistic: Callable[[Tensor], float], n_units: int, *, seed: int = SEED,
              resamples: int = RESAMPLES) -> Interval:
    """``statistic`` on all units (the point value) and its BCa 95 % interval over ``resamples``
    bootstrap resamples of the units (SPEC §8). ``statistic`` takes a 1-D tensor of unit indices
    (with repeats); resamples where it is NaN are left out of the interval."""
    def one(idx: Tensor) -> Tensor:
        return torch.tensor([float(statistic(idx))], dtype=torch.float64)

    return bootstraps(one, n_units, seed=seed, resamples=resamples)[0]


def bootstraps(statistic: Callable[[Tensor], Tensor], n_units: int, *, seed: int = SEED,
               resamples: int = RESAMPLES, indices: Tensor | None = None) -> list[Interval]:
    """:func:`bootstrap` for a statistic that returns several numbers (a 1-D tensor) from the same
    resamples: one :class:`Interval` each, read from one pass over the draws and one over the
    jackknife (each unit left out once). ``indices`` (``[resamples, n_units]``) replaces the
    seeded draws, e.g. to hold the interval to another implementation's on the same draws."""
    value = statistic(torch.arange(n_units)).double()
    if n_units < MIN_UNITS:
        return [Interval(float(v), math.nan, math.nan, n_units) for v in value]
    drawn = draws(n_units, resamples, seed) if indices is None else indices
    values = torch.stack([statistic(idx).double() for idx in drawn])
    every_unit = torch.arange(n_units)
    jackknife = torch.stack([statistic(every_unit[every_unit != i]).double() for i in range(n_units)])
    out = []
    for v, column, left_out in zip(value.tolist(), values.T, jackknife.T):
        low, high = bca(v, column, left_out)
        out.append(Interval(v, low, high, n_units))
    return out


def bca(point: float, resampled: Tensor, jackknife: Tensor, level: float = LEVEL) -> tuple[float, float]:
    """The bias-corrected and accelerated interval (Efron & Tibshirani 1993, §14.3, eq. 14.15;
    ``scipy.stats.bootstrap(method="BCa")``) of a statistic ``point`` from its bootstrap values
    ``resampled`` and its leave-one-out values ``jackknife``::

        z0 = Φ⁻¹((#{θ* < θ} + #{θ* ≤ θ}) / 2B)              bias correction
        a  = Σ d³ / (6 (Σ d²)^{3/2}),  d = mean(θ₍ᵢ₎) − θ₍ᵢ₎    acceleration
        α₁,₂ = Φ(z0 + (z0 + z)/(1 − a(z0 + z))),  z = Φ⁻¹((1 ∓ level)/2)

    and the ends are the α₁ and α₂ quantiles of ``resampled`` (linear interpolation). Resamples
    and leave-one-out values that are not finite are left out (a resample where the statistic is
    undefined); NaN ends where none is left, where the point is not finite, or where every
    resample lies on one side of the point (z0 infinite: the interval cannot be corrected).
    A statistic whose leave-one-out values are all equal has no acceleration (a = 0).
    """
    resampled = resampled[torch.isfinite(resampled)].double()
    jackknife = jackknife[torch.isfinite(jackknife)].double()
    if not resampled.numel() or not math.isfinite(point):
        return math.nan, math.nan
    below = (resampled < point).sum() + (resampled <= point).sum()
    z0 = torch.special.ndtri(below.double() / (2 * resampled.numel()))
    if not torch.isfinite(z0):
        return math.nan, math.nan
    d = jackknife.mean() - jackknife
    spread = (d * d).sum()
    a = (d**3).sum() / (6 * spread**1.5) if spread > 0 else torch.tensor(0.0, dtype=torch.float64)
    ends = []
    for tail in ((1 - level) / 2, (1 + level) / 2):
        z = z0 + torch.special.ndtri(torch.tensor(tail, dtype=torch.float64))
        ends.append(torch.special.ndtr(z0 + z / (1 - a * z)))
    low, high = torch.quantile(resampled, torch.stack(ends)).tolist()
    return low, high


def blocks(lengths: Sequence[int], block: int = BLOCK) -> Tensor:
    """``[n_blocks, block]`` indices into the queries of every window pooled in order (window
    lengths ``lengths``): consecutive blocks inside each window, its partial last block dropped
    (SPEC §5). Resample the rows when windows are fewer than :data:`MIN_UNITS`."""
    rows, start = [], 0
    for length in lengths:
        full = length // block
        rows.append(start + torch.arange(full * block).reshape(full, block))
        start += length
    return torch.cat(rows) if rows else torch.zeros(0, block, dtype=torch.long)


def decide(interval: Interval, low: float = -math.inf, high: float = math.inf) -> str:
    """The rule ``low ≤ x ≤ high`` on ``interval`` (SPEC §8): held, not held, undecided, too few."""
    if interval.too_few:
        return TOO_FEW
    if math.isnan(interval.low):
        return UNDECIDED  # no resample defined it: nothing can be said either way
    if low <= interval.low and interval.high <= high:
        return HELD
    if interval.high < low or interval.low > high:
        return NOT_HELD
    return UNDECIDED


def categorize(interval: Interval,
               categories: Sequence[tuple[str, float, float]] = GEOMETRY) -> str:
    """The category whose band ``(name, low, high)`` holds the whole interval, or "undecided
    between X and Y" naming the lowest and highest bands it reaches (SPEC §3, §8)."""
    if interval.too_few:
        return TOO_FEW
    if math.isnan(interval.low):
        return UNDECIDED
    reached = [name for name, low, high in categories if interval.low <= high and interval.high >= low]
    if len(reached) == 1:
        return reached[0]
    return f"{UNDECIDED} between {reached[0]} and {reached[-1]}"


def weak_sink(result: Any) -> bool:
    """Whether the analysis's sink check found a weak sink (``metadata["sink"]["weak"]``, SPEC §1);
    False for a result without the check (files written before it: read as before)."""
    record = getattr(result, "metadata", {}).get("sink")
    return isinstance(record, Mapping) and record.get("weak") is True


def window_values(result: Any, metric: str, group: str = "top") -> Tensor | None:
    """Each window's own mean of ``metric`` for ``group`` (``WINDOW_GROUPS``), ``[window, layer,
    head, n]`` in float64, from ``result.window_scores``; None where the result holds no
    per-window arrays (analysed without ``per_window=True``, or an older file)."""
    scores = getattr(result, "window_scores", None)
    if scores is None:
        return None
    return scores[:, WINDOW_GROUPS.index(group), names()["metric"].index(metric)].double()


def window_sink_values(result: Any, field: str) -> Tensor | None:
    """Each window's sink figure ``field`` (``mass``, ``norm_ratio``, ``cosine``, ...), ``[window,
    layer, head]`` in float64, from ``result.window_sink``; None without per-window arrays."""
    sink = getattr(result, "window_sink", None)
    if sink is None:
        return None
    return sink[:, names()["sink_field"].index(field)].double()


#: Within :func:`remembered`: what each :func:`per_run` function returned, by its arguments.
_REMEMBERED: dict[tuple[Any, ...], tuple[tuple[Any, ...], Any]] | None = None
_Fn = TypeVar("_Fn", bound=Callable[..., Any])


@contextlib.contextmanager
def remembered() -> Iterator[None]:
    """Within it, each :func:`per_run` function computes once per arguments: the page decides
    every claim on all runs and again on each model's runs alone (its size section), on the
    same result objects, and their resampled intervals are most of its time. The functions'
    results must not be changed by their readers."""
    global _REMEMBERED
    outer = _REMEMBERED
    _REMEMBERED = {} if outer is None else outer
    try:
        yield
    finally:
        _REMEMBERED = outer


def per_run(fn: _Fn) -> _Fn:
    """``fn`` computed once per arguments within :func:`remembered` (an object argument by its
    identity, which the memo pins by holding it; numbers, strings and tuples of them by value),
    and every time outside it."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if _REMEMBERED is None:
            return fn(*args, **kwargs)
        named = sorted(kwargs.items())
        key = (fn.__module__, fn.__qualname__, *map(_identity, args),
               *((name, _identity(value)) for name, value in named))
        if key not in _REMEMBERED:
            _REMEMBERED[key] = ((args, kwargs), fn(*args, **kwargs))
        return _REMEMBERED[key][1]

    return wrapper  # type: ignore[return-value]


def _identity(arg: Any) -> Any:
    """An argument's memo key: a number, string or ``None`` itself, a list or tuple by its
    items, anything else by ``id`` (pinned by the memo, so never reused meanwhile)."""
    if arg is None or isinstance(arg, (bool, int, float, str)):
        return (type(arg).__name__, arg)  # True and 1 apart
    if isinstance(arg, (list, tuple)):
        return (type(arg).__name__, *map(_identity, arg))
    return ("id", id(arg))


def head_means(values: Tensor | WindowMeans, idx: Tensor) -> Tensor:
    """Each head's mean over the drawn windows ``idx`` (NaN-aware: a window where the figure is
    undefined is left out, as the analysis's own means do), the heads fixed. ``values`` is the
    per-window array ``[window, ...]``, or its :class:`WindowMeans` for a statistic that reads it
    on every resample."""
    return values(idx) if isinstance(values, WindowMeans) else values[idx].nanmean(0)


class WindowMeans:
    """The per-window array ``values`` (``[window, ...]``) made ready for :func:`head_means` on
    many resamples: a resample ``idx`` draws window ``w`` ``c_w`` times, so each entry's mean over
    the drawn windows is ``Σ_w c_w·x_w / Σ_w c_w·[x_w defined]`` — two products with the counts
    ``c`` instead of gathering ``len(idx)`` copies of the windows (``values[idx].nanmean(0)``, the
    same mean up to the order of the float64 sums). An array holding ``±inf`` is read the gathering
    way (``0·inf`` would poison the products)."""

    def __init__(self, values: Tensor) -> None:
        self.values = values
        self.n_windows, self.shape = values.shape[0], values.shape[1:]
        self.gather = bool(torch.isinf(values).any())
        if not self.gather:
            defined = ~torch.isnan(values)
            self.sums = torch.where(defined, values, 0.0).reshape(self.n_windows, -1)
            self.defined = defined.to(values.dtype).reshape(self.n_windows, -1)

    def __call__(self, idx: Tensor) -> Tensor:
        if self.gather:
            return self.values[idx].nanmean(0)
        counts = torch.bincount(idx, minlength=self.n_windows).to(self.sums.dtype)
        return (counts @ self.sums / (counts @ self.defined)).reshape(self.shape)

    def sums_over(self, idx: Tensor) -> Tensor:
        """The sum over the drawn windows ``idx`` (NaN where a drawn window's entry is NaN), e.g.
        each head's votes over a resample."""
        if self.gather:
            return self.values[idx].sum(0)
        counts = torch.bincount(idx, minlength=self.n_windows).to(self.sums.dtype)
        undefined = counts @ (1.0 - self.defined) > 0
        return torch.where(undefined, math.nan, counts @ self.sums).reshape(self.shape)


def over_heads(values: Tensor) -> Tensor:
    """``[layer, head, *rest]`` → the mean over heads of each ``rest`` entry (NaN-aware)."""
    return values.flatten(0, 1).nanmean(0)


def median_of(values: Tensor) -> Tensor:
    """The median of the finite entries (the mean of the two middle ones), NaN for none: the
    median the page prints (:func:`.stats.median`), as a tensor."""
    values = values[torch.isfinite(values)].double()
    return values.quantile(0.5) if values.numel() else torch.tensor(math.nan, dtype=torch.float64)


def with_units(interval: Interval, units: int) -> Interval:
    """``interval`` of a statistic over ``units`` defined units (e.g. KV heads): too few below
    :data:`MIN_UNITS` of them (SPEC §8), whatever the number of windows."""
    if units < MIN_UNITS and not interval.too_few:
        return Interval(interval.value, math.nan, math.nan, units)
    return interval


def every(outcomes: Sequence[str]) -> str:
    """A rule that must hold at every one of several points (e.g. every headline N): not held
    where one is not held, held where all are, too few or no interval where one is, else
    undecided. Not held without any point."""
    if not outcomes or NOT_HELD in outcomes:
        return NOT_HELD
    for missing in MISSING:
        if missing in outcomes:
            return missing
    return HELD if all(o == HELD for o in outcomes) else UNDECIDED


def some(outcomes: Sequence[str]) -> str:
    """A rule that must hold at one point at least: held where one is held, not held where every
    one is not held (and without any point), too few or no interval where one is, else undecided."""
    if HELD in outcomes:
        return HELD
    if all(o == NOT_HELD for o in outcomes):
        return NOT_HELD
    for missing in MISSING:
        if missing in outcomes:
            return missing
    return UNDECIDED


def point(ok: bool) -> str:
    """A check decided on a point value where the number has no per-window values at all (the
    rule reads figures that are not means over windows): held or not held, as before SPEC §8."""
    return HELD if ok else NOT_HELD


def combine(per_run: dict[str, list[str]],
            rule: str | Callable[[dict[str, list[bool]]], str]) -> str:
    """A claim's verdict from each check's per-run outcomes (held / not held / undecided / too
    few / no interval / no sink). ``rule`` maps per-run booleans to a verdict, or names the core check of
    :func:`.rules.verdict`. It is read once with every undecided outcome as held and once as not
    held: the verdict where both agree, else "undecided" naming the two. Outcomes "too few",
    "no interval" and "no sink" carry no verdict and are left out; with nothing left (for a named
    core: in it) the claim is "no interval" where that is what is missing (and nothing is too
    few), "no sink" where every run is, else "too few"."""
    kept = {k: [v for v in vs if v not in MISSING] for k, vs in per_run.items()}
    if (not kept.get(rule)) if isinstance(rule, str) else not any(kept.values()):
        dropped = per_run.get(rule, []) if isinstance(rule, str) else [v for vs in per_run.values() for v in vs]
        if dropped and TOO_FEW not in dropped and NO_INTERVAL in dropped:
            return NO_INTERVAL
        if dropped and all(v == NO_SINK for v in dropped):
            return NO_SINK
        return TOO_FEW
    read = (lambda checks: verdict(checks, rule)) if isinstance(rule, str) else rule
    best = read({k: [v in (HELD, UNDECIDED) for v in vs] for k, vs in kept.items()})
    worst = read({k: [v == HELD for v in vs] for k, vs in kept.items()})
    return best if best == worst else f"{UNDECIDED} ({worst} or {best})"


__all__ = [
    "BLOCK",
    "GEOMETRY",
    "HELD",
    "LEVEL",
    "MIN_UNITS",
    "MISSING",
    "NOT_HELD",
    "NOT_MEASURED",
    "NO_INTERVAL",
    "NO_SINK",
    "PARTLY",
    "RESAMPLES",
    "TOO_FEW",
    "UNDECIDED",
    "Interval",
    "WindowMeans",
    "bca",
    "blocks",
    "bootstrap",
    "bootstraps",
    "categorize",
    "combine",
    "decide",
    "draws",
    "every",
    "head_means",
    "median_of",
    "over_heads",
    "point",
    "some",
    "weak_sink",
    "window_sink_values",
    "window_values",
    "with_units",
]
