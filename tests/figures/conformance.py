"""One harness for the figure families: every implementation of a family's figures against the
slow loop reference (tests/reference.py), on the same synthetic caches.

An implementation is anything that reads like a one-layer ``HeadAnalysis`` (``metric``,
``sink_diagnostic``, ``bound``): the engine's compiled kernels (``backend="numba"``), their torch
twins (``backend="torch"``), and the functional layer (:class:`FunctionalFigures`: the
``tl_geometry.functional`` entry points per query, averaged by the engine's protocol). Each
family's figures are read from the figures table (``FIGURES``), so a new figure on its axis is
compared as soon as it exists, and fails until the reference (and each implementation) has it.

The engine runs and the reference are computed once per scenario and shared by every family.
"""

from __future__ import annotations

import functools
import warnings
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from cases import Case, make_case
from reference import BOUND_KINDS, ref_analyze, ref_bounds
from shared_checks import assert_metrics_equal_reference
from streams import engine_randoms, engine_shuffles

import tl_geometry
import tl_geometry.functional as F
from tl_geometry.functional.figures import FIGURES
from tl_geometry.result import BOUND_KINDS as RESULT_BOUND_KINDS

N_VALUES = (1, 2, 3, 5, 8)
SAMPLES = 3  # random subsets and value shuffles per instance
#: The engine against the reference: float64 sums of the same inputs in another order, round-off
#: only (relative and absolute).
TOL = 1e-9
#: The functional layer against the reference: it forms Euclidean distances from the expanded
#: square ``α²‖v‖² − 2α⟨v, s⟩ + ‖s‖²`` (the engine compares ``E = D² − ‖s‖²`` instead), so a
#: zero distance comes back as the square root of a round-off, about 1e-8 on these caches: the
#: margin at N = 1 moves by that much. The counts (P, R, F, GInv) are unaffected.
FUNCTIONAL_TOL = 1e-6


def figures_of(axis: str, spec: str | None = None) -> tuple[str, ...]:
    """The figures on ``axis`` (of SPEC section ``spec`` only, if given), in the table's order."""
    found = tuple(f.name for f in FIGURES if f.axis == axis and (spec is None or f.spec == spec))
    assert found, f"the figures table has no figure on {axis!r} (SPEC {spec})"
    return found


#: The families: SPEC §3's separability metrics, SPEC §10's truncation figures (both on the metric
#: axis), SPEC §4's sink fields and SPEC §6's bound metrics.
SEPARABILITY = figures_of("metric", "§3")
TRUNCATION = figures_of("metric", "§10")
SINK = figures_of("sink_field")
BOUND_METRICS = figures_of("bound_metric")
#: The selections every metric is averaged over (SPEC §3): the top-N set, the top-N set
#: re-selected without the sink, and the two baselines (random subsets, shuffled values).
GROUPS = ("top", "sink_removed", "random", "shuffled")
BASELINES = ("random", "shuffled")
#: The bound kinds the reference covers (the regime bounds of SPEC §6b have none).
BOUND_KINDS_COVERED = BOUND_KINDS
assert set(BOUND_KINDS_COVERED) <= set(RESULT_BOUND_KINDS)


@dataclass(frozen=True)
class Scenario:
    """A synthetic cache (``make_case``'s options) and the query protocol it is read with."""

    name: str
    seed: int
    options: tuple[tuple[str, Any], ...]
    queries: str
    window: int | None = None

    def __str__(self) -> str:
        return f"{self.name}-{self.queries}"

    def has(self, option: str) -> bool:
        """Whether the cache was made with ``option`` (``"duplicates"``, ``"sink"``, ...) on."""
        return bool(dict(self.options).get(option))

    def case(self) -> Case:
        return make_case(self.seed, batch=3, window=self.window, **dict(self.options))

    def mask(self) -> np.ndarray | None:
        mask = self.case().attention_mask
        return None if mask is None else mask.numpy()


def _scenarios() -> list[Scenario]:
    cases = [
        # GQA (4 query heads on 2 KV heads), a compressed sink, attention ties and duplicated
        # value vectors (exact distance ties).
        ("sink-ties-duplicates", 90, {"ties": True, "duplicates": True, "sink": True}, None),
        ("right-padding-gqa", 91, {"padding": "right", "n_heads": 6, "n_kv": 3}, None),
        ("left-padding-mqa", 92, {"padding": "left", "n_kv": 1}, None),
        # A sliding window of 5 keys: the last queries do not see the sink, N = 8 fits no window.
        ("window-sink", 93, {"sink": True, "n_pos": 14}, 5),
    ]
    return [Scenario(name, seed, tuple(options.items()), queries, window)
            for name, seed, options, window in cases for queries in ("last", "all")]


SCENARIOS = _scenarios()


# --- the reference and the engine, once per scenario -------------------------------------------


@functools.cache
def reference(scenario: Scenario) -> dict:
    """``ref_analyze`` of the scenario, with the engine's random subsets and value shuffles."""
    case, mask = scenario.case(), scenario.mask()
    return ref_analyze(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                       queries=scenario.queries, attention_mask=mask, window=scenario.window,
                       randoms=engine_randoms(0, 0, mask, SAMPLES), shuffles=engine_shuffles(0, 0, mask, SAMPLES))


@functools.cache
def reference_bounds(scenario: Scenario) -> dict:
    """``ref_bounds`` of the scenario."""
    case = scenario.case()
    return ref_bounds(case.pattern.double().numpy(), case.v.double().numpy(), N_VALUES,
                      queries=scenario.queries, attention_mask=scenario.mask(), window=scenario.window)


@functools.cache
def engine(scenario: Scenario, backend: str) -> tl_geometry.HeadAnalysis:
    """``analyze_heads`` of the scenario on ``backend``, bounds included."""
    case = scenario.case()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # N beyond a short sequence or a window is NaN, as it says
        return tl_geometry.analyze_heads(
            case.cache(), n_values=N_VALUES, attention_mask=case.attention_mask, queries=scenario.queries,
            window=scenario.window, random_samples=SAMPLES, shuffle_samples=SAMPLES, bounds=True,
            backend=backend)


# --- the functional layer, averaged as the engine averages ---------------------------------------


def _visible(real: torch.Tensor, queries: list[int], window: int | None) -> torch.Tensor:
    """``[query, key]``: the real keys each query sees (causal, and its window; SPEC §1)."""
    keys = torch.arange(real.shape[0])
    t = torch.tensor(queries)[:, None]
    seen = real[None, :] & (keys[None, :] <= t)
    return seen if window is None else seen & (keys[None, :] > t - window)


def _separated(bound: F.Bounds) -> torch.Tensor:
    """1 where the bound certifies P = R = 1, 0 where not, NaN where undefined (ours)."""
    p, r = bound.precision, bound.recall
    return torch.where(p.isnan() | r.isnan(), torch.nan, ((p == 1) & (r == 1)).double())


class FunctionalFigures:
    """The figures of one scenario from ``tl_geometry.functional``, read like a one-layer
    ``HeadAnalysis``.

    Per sequence (sink: its first real token) and chosen query, the functional entry points
    score each row: ``separability`` and ``truncation`` of the top-N set ("top") and of the
    top-N set without the sink ("sink_removed": candidates without it, tail and output with
    it), ``sink_diagnostics``, ``inversion_bounds`` and ``shell_bounds``. The sink-dependent
    figures are read at the last query that sees the sink under ``queries="last"`` (SPEC §1),
    and are NaN where the query does not see it. Per sequence the nan-mean over its chosen
    queries, then the nan-mean over sequences. The baselines' random streams are the engine's
    own: the functional layer has no entry point for them, so it covers ``GROUPS`` only.
    """

    GROUPS = ("top", "sink_removed")
    BOUND_KINDS = ("inversion", "shell", "shell_n")

    def __init__(self, scenario: Scenario) -> None:
        case = scenario.case()
        pattern, v = case.pattern.double(), case.v.double()
        batch, n_heads, n_pos, _ = pattern.shape
        values = v.permute(0, 2, 1, 3)[:, F.kv_head_index(n_heads, v.shape[2])]  # [b, head, key, d]
        real = (torch.ones(batch, n_pos, dtype=torch.bool) if case.attention_mask is None
                else case.attention_mask.bool())
        window, keys = scenario.window, torch.arange(n_pos)
        per_seq: dict[tuple[str, str], list[torch.Tensor]] = defaultdict(list)
        for b in range(batch):
            positions = torch.nonzero(real[b]).flatten().tolist()
            sink = positions[0]
            chosen = positions if scenario.queries == "all" else positions[-1:]
            at_sink = [min(t, sink + window - 1) if scenario.queries == "last" and window else t for t in chosen]
            vals = values[b][:, None]  # [head, 1, key, d]: every query of a head reads the same values
            top_keys = _visible(real[b], chosen, window)
            sink_keys = _visible(real[b], at_sink, window)
            sees = sink_keys[:, sink]  # [query]
            without = sink_keys & (keys != sink)
            alpha = torch.where(top_keys, pattern[b][:, chosen], 0.0)  # [head, query, key]
            alpha_s = torch.where(sink_keys, pattern[b][:, at_sink], 0.0)
            rows: dict[tuple[str, str], list[torch.Tensor]] = defaultdict(list)  # [head, query] per n
            for n in N_VALUES:
                top = F.separability(alpha, vals, n, key_mask=top_keys)
                cut = F.truncation(alpha, vals, n, key_mask=top_keys)
                removed = F.separability(alpha_s, vals, n, key_mask=without)
                # The sink stays in the tail and the output; N is in range among the other keys.
                removed_cut = F.truncation(alpha_s, vals, n, key_mask=sink_keys,
                                           selected=F.top_n_mask(alpha_s, n, without))
                in_range = sees & (n < without.sum(-1))
                for name, x in (*top._asdict().items(), *cut._asdict().items()):
                    rows[("top", name)].append(x)
                for name, x in (*removed._asdict().items(), *removed_cut._asdict().items()):
                    rows[("sink_removed", name)].append(torch.where(in_range, x, torch.nan))
                bounds = {"inversion": F.inversion_bounds(n, top.inversions),
                          "shell": F.shell_bounds(alpha, vals, n, k=0, key_mask=top_keys),
                          "shell_n": F.shell_bounds(alpha, vals, n, k=n, key_mask=top_keys)}
                for kind, bound in bounds.items():
                    for name, x in (*bound._asdict().items(), ("separated", _separated(bound))):
                        rows[(f"bound_{kind}", name)].append(x)
            for key, xs in rows.items():
                per_seq[key].append(torch.stack(xs, -1).nanmean(1))  # [head, n]
            diagnostics = F.sink_diagnostics(alpha_s, vals, sink_keys, sink)
            for name, x in diagnostics._asdict().items():
                per_seq[("sink", name)].append(torch.where(sees, x, torch.nan).nanmean(1))  # [head]
        self._figures = {key: torch.stack(xs).nanmean(0)[None] for key, xs in per_seq.items()}

    def _read(self, family: str, name: str) -> torch.Tensor:
        if (family, name) not in self._figures:
            raise KeyError(f"the functional layer computes no {family} figure {name!r}")
        return self._figures[(family, name)]

    def metric(self, name: str, group: str = "top") -> torch.Tensor:
        return self._read(group, name)

    def sink_diagnostic(self, name: str) -> torch.Tensor:
        return self._read("sink", name)

    def bound(self, kind: str, metric: str = "f_score") -> torch.Tensor:
        return self._read(f"bound_{kind}", metric)


@functools.cache
def functional(scenario: Scenario) -> FunctionalFigures:
    return FunctionalFigures(scenario)


# --- the implementations ------------------------------------------------------------------------


@dataclass(frozen=True)
class Implementation:
    """One implementation of the figures: how it reads a scenario, the metric groups and bound
    kinds it computes, and its tolerance against the reference."""

    name: str
    run: Callable[[Scenario], Any]
    groups: tuple[str, ...] = GROUPS
    bound_kinds: tuple[str, ...] = BOUND_KINDS_COVERED
    tol: float = TOL

    def __str__(self) -> str:
        return self.name


IMPLEMENTATIONS = (
    Implementation("numba", functools.partial(engine, backend="numba")),
    Implementation("torch", functools.partial(engine, backend="torch")),
    Implementation("functional", functional, groups=FunctionalFigures.GROUPS,
                   bound_kinds=FunctionalFigures.BOUND_KINDS, tol=FUNCTIONAL_TOL),
)


def assert_compares_something(want: dict, keys) -> None:
    """Every one of ``keys`` has a defined value in the reference somewhere: an all-NaN figure
    would pass any comparison."""
    for key in keys:
        assert not np.isnan(want[key]).all(), f"the reference's {key} is NaN everywhere"


def assert_family_equals_reference(implementation, scenario, groups, metrics) -> None:
    """``implementation``'s ``metrics`` of ``groups`` (those it computes) on ``scenario`` equal
    the loop reference's, and the reference defines each of them somewhere."""
    want = reference(scenario)
    groups = [g for g in groups if g in implementation.groups]
    assert_metrics_equal_reference(implementation.run(scenario), want, groups, metrics, tol=implementation.tol,
                                   what=f"{implementation} ")
    assert_compares_something(want, [f"{g}_{m}" for g in groups for m in metrics])
