"""Hypothesis property tests of the theorems of SPEC §3 on the vectorised functional layer.

Every property below is a theorem about *exact* arithmetic, stated for the metrics exactly as
the SPEC defines them (closed outer ball for precision, strict inner ball for recall):

1. inversion certificates ``P ≥ N/(N+GInv)`` and ``R ≥ max(0, 1 − GInv/N)``;
2. ``γ > 0 ⇔ GInv = 0 ⇔ P = R = F = 1``;
3. Euclidean ``N = 1``: ``F_1 = 1`` for a singleton whose contribution no other key shares;
4. permutation invariance (explicit selections, and top-N when the top-N set is tie-free or the
   permutation keeps the order of tied keys);
5. scale invariance of the Euclidean P/R/F/GInv (γ scales by ``c``) and of every cosine figure;
6. bounds, and NaN exactly where ``N`` is outside ``1 ≤ N < |valid keys|``;
7. the random baseline's subsets (``random_ranks``): exactly ``N`` valid keys, nested in ``N``.

Properties 1, 2 and 6 follow from the *computed* distances alone, whatever their rounding, so
they are checked on every generated case. Properties 3-5 compare two computations whose
rounding differs (another key order, another scale, another batch layout); a pair of distances
closer than the rounding can then be ordered either way, which would make the tests flaky
without saying anything about the code. Rows where a selected/unselected pair of distances is
such a *near* tie (measured on a direct, unfactored float64 recomputation, see
:func:`_comparable_rows`) are therefore left out of those comparisons — except *exact* ties
between identical contributions (same ``α`` and same ``v``), which the SPEC's tie rules define
and which must survive any permutation or scaling exactly (the ``exact_ties=True`` cases).

Generated inputs: α rows are softmaxes of random logits (sometimes rounded, which creates exact
attention ties), values are random (sometimes with duplicated rows, copied with or without the
attention of the source key, sometimes with a small "sink" at key 0 pointing against the mean
of the others); layouts are one row ``[key]``, rows ``[rows, key]`` with their own values,
``[rows, q, key]`` against values broadcast as ``[rows, 1, key, d]``, one ``[key, d]`` block shared
by all rows, and values broadcast over a leading dimension (:data:`LAYOUTS`); optional random key
masks; key counts 2..12 and ``d`` 1..6; float64 or float32 inputs. Structural choices are drawn by
Hypothesis (so they shrink); the bulk numbers come from a drawn seed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import tl_geometry.functional as F

METRICS = ("precision", "recall", "f_score", "margin", "inversions")
DISTANCES = ("euclidean", "cosine")
ETA = 1e-12  # the η of the cosine distance (SPEC §3)

# Relative size below which two distances count as a near tie (see _comparable_rows). The
# factored Euclidean distance D² = α²‖v‖² − 2α⟨v,s⟩ + ‖s‖² carries an absolute error of a few ulp
# of ‖y‖² + ‖s‖² on D², so D² gaps are compared against that scale; cosine distances are O(1).
NEAR_TIE = 1e-9

PROPERTY_SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
#: The comparison tests score two cases per example (and build the near-tie filter twice).
COMPARISON_SETTINGS = settings(PROPERTY_SETTINGS, max_examples=100)


@pytest.fixture(autouse=True, scope="module")
def _one_intra_op_thread():
    """Run on one intra-op thread: the tensors here are tiny, and on a busy machine OpenMP's
    thread hand-off makes every small op cost milliseconds (30× the suite's run time)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# ---------------------------------------------------------------------------------------------
# generated cases
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    alpha: torch.Tensor  # [*rows, key]
    values: torch.Tensor  # [*vrows, key, d], broadcasting against alpha's leading dims
    key_mask: torch.Tensor | None  # [*rows, key] or None (all keys valid)
    n: int
    selected: torch.Tensor | None  # explicit selection [*rows, key], or None: top-n
    exact_pairs: tuple[tuple[int, int], ...]  # keys with identical contributions (same α, same v)

    @property
    def n_keys(self) -> int:
        return self.alpha.shape[-1]

    def mask(self) -> torch.Tensor:
        if self.key_mask is None:
            return torch.ones(self.alpha.shape, dtype=torch.bool)
        return self.key_mask

    def selection(self) -> torch.Tensor:
        """The selection scored by ``separability`` (explicit, or the top-n set)."""
        if self.selected is not None:
            return self.selected
        return F.top_n_mask(self.alpha, self.n, self.key_mask)

    def defined(self) -> torch.Tensor:
        n_valid = self.mask().sum(-1)
        return (self.n >= 1) & (self.n < n_valid)

    def run(self, distance: str) -> F.Separability:
        return F.separability(
            self.alpha, self.values, self.n, key_mask=self.key_mask, selected=self.selected,
            distance=distance,
        )

    def permuted(self, perm: list[int]) -> Case:
        """The same case with its keys reordered: key ``perm[k]`` becomes key ``k``."""
        idx = torch.tensor(perm)
        where = {old: new for new, old in enumerate(perm)}
        return replace(
            self,
            alpha=self.alpha[..., idx],
            values=self.values[..., idx, :],
            key_mask=None if self.key_mask is None else self.key_mask[..., idx],
            selected=None if self.selected is None else self.selected[..., idx],
            exact_pairs=tuple((where[i], where[j]) for i, j in self.exact_pairs),
        )


#: Leading dimensions of alpha and of values for given row / query counts ``b, q``.
LAYOUTS = {
    "row": lambda b, q: ((), ()),  # one query: [key] and [key, d]
    "rows": lambda b, q: ((b,), (b,)),  # rows with their own values
    "broadcast": lambda b, q: ((b, q), (b, 1)),  # [rows, q, key] vs [rows, 1, key, d]
    "shared": lambda b, q: ((b, q), ()),  # one [key, d] block for every row
    # values shared over a *leading* dimension, kept dims after it: [q, rows, 2, key] vs
    # [1, rows, 2, key, d] (exercises value_dots' fold and unfold of the batch dimensions)
    "leading": lambda b, q: ((q, b, 2), (1, b, 2)),
}


@st.composite
def cases(
    draw,
    *,
    selection: str | None = None,  # "top" | "random" | None (either)
    exact_ties: bool | None = None,  # identical contributions: forced (True), excluded (False)
    n_in_range: bool = True,  # n in 1..key-1 (rows may still be undefined under a mask)
    masked: bool | None = None,
    distinct_alpha: bool = False,  # no exact attention ties among the keys
) -> Case:
    k = draw(st.integers(2, 12), label="keys")
    d = draw(st.integers(1, 6), label="d")
    layout = draw(st.sampled_from(list(LAYOUTS)), label="layout")
    b = draw(st.integers(1, 3), label="rows")
    q = draw(st.integers(1, 3), label="queries")
    lead, vlead = LAYOUTS[layout](b, q)
    seed = draw(st.integers(0, 2**31 - 1), label="seed")
    g = torch.Generator().manual_seed(seed)

    logit_scale = draw(st.sampled_from([0.5, 2.0, 4.0]), label="logit_scale")
    logits = torch.randn(*lead, k, generator=g, dtype=torch.float64) * logit_scale
    ties = False if distinct_alpha else draw(st.booleans(), label="alpha_ties")
    if ties:  # few logit levels: exact attention ties
        logits = logits.round()
    value_scale = draw(st.sampled_from([0.1, 1.0, 10.0]), label="value_scale")
    values = torch.randn(*vlead, k, d, generator=g, dtype=torch.float64) * value_scale

    if draw(st.booleans(), label="sink"):  # a small sink at key 0, against the others' mean
        others = values[..., 1:, :].mean(-2)
        direction = others / others.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        sink_norm = draw(st.sampled_from([0.05, 0.15, 0.5]), label="sink_norm")
        values[..., 0, :] = -sink_norm * value_scale * direction
        logits[..., 0] += draw(st.sampled_from([0.0, 3.0]), label="sink_boost")

    # Duplicated value rows on disjoint key pairs; the copy takes the source's attention (an
    # exact duplicate contribution) or a clearly different one (same v, different y).
    min_pairs = 1 if exact_ties else 0
    n_pairs = draw(st.integers(min_pairs, k // 2), label="duplicate_pairs")
    order = draw(st.permutations(range(k)), label="duplicate_keys")
    exact_pairs = []
    for p in range(n_pairs):
        src, dst = order[2 * p], order[2 * p + 1]
        values[..., dst, :] = values[..., src, :]
        copy_alpha = exact_ties if exact_ties is not None else draw(st.booleans(), label="copy_a")
        if copy_alpha:
            logits[..., dst] = logits[..., src]
            exact_pairs.append((src, dst))
        else:
            logits[..., dst] = logits[..., src] + draw(
                st.sampled_from([0.5, 1.25, -0.75]), label="alpha_offset"
            )
    if distinct_alpha:
        assume(not exact_pairs)

    key_mask = None
    if masked if masked is not None else draw(st.booleans(), label="masked"):
        p_valid = draw(st.sampled_from([0.5, 0.8]), label="p_valid")
        key_mask = torch.rand(*lead, k, generator=g) < p_valid
        if exact_ties:  # keep the exact duplicates valid so that they matter
            for src, dst in exact_pairs:
                key_mask[..., src] = key_mask[..., dst] = True
    valid = key_mask if key_mask is not None else torch.ones(*lead, k, dtype=torch.bool)
    alpha = torch.softmax(logits.masked_fill(~valid, -math.inf), dim=-1).nan_to_num(0.0)

    n = draw(st.integers(1, k - 1) if n_in_range else st.integers(-1, k + 1), label="n")
    kind = selection or draw(st.sampled_from(["top", "random"]), label="selection")
    selected = None
    if kind == "random":
        # A uniformly random n-subset of the valid keys of every row (all of them / none when n
        # is out of range, which separability accepts for such rows).
        keys = torch.where(valid, torch.rand(*lead, k, generator=g), 2.0)
        ranks = keys.argsort(-1).argsort(-1)
        selected = (ranks < n) & valid

    dtype = draw(st.sampled_from([torch.float64, torch.float32]), label="dtype")
    return Case(alpha.to(dtype), values.to(dtype), key_mask, n, selected, tuple(exact_pairs))


# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------


def _direct_distances(case: Case, distance: str, scale: float = 1.0):
    """``D_i`` from the dense contributions ``y = α·v`` in float64 (tests only, tiny shapes).

    Returns the distances and the Euclidean scale² ``max‖y‖² + ‖s‖²`` of each row.
    """
    alpha = case.alpha.double()
    values = case.values.double() * scale
    y = alpha[..., None] * values  # [*rows, key, d]
    sel = case.selection()
    s = (y * sel[..., None]).sum(-2, keepdim=True)
    mask = case.mask()
    y_sq = (y * y).sum(-1)
    s_sq = (s * s).sum(-1)[..., 0]
    if distance == "euclidean":
        dist = (y - s).norm(dim=-1)
    else:
        dist = 1 - (y * s).sum(-1) / (y.norm(dim=-1) * s.norm(dim=-1) + ETA)
    scale_sq = torch.where(mask, y_sq, 0.0).amax(-1) + s_sq
    return dist, scale_sq


def _pair_gaps(case: Case, distance: str, scale: float = 1.0):
    """Gaps between every selected and every unselected valid key's distance, per row.

    Returns ``gap [*rows, key(sel), key(unsel)]`` (signed: ``D_j − D_i`` in the units of the
    near-tie test; +inf for pairs that are not selected/unselected) and ``exact`` marking the
    pairs of identical contributions.
    """
    dist, scale_sq = _direct_distances(case, distance, scale)
    sel = case.selection()
    uns = case.mask() & ~sel
    if distance == "euclidean":
        sq = dist * dist
        gap = (sq[..., None, :] - sq[..., :, None]) / scale_sq[..., None, None].clamp_min(1e-300)
    else:
        gap = dist[..., None, :] - dist[..., :, None]
    pair = sel[..., :, None] & uns[..., None, :]
    gap = torch.where(pair, gap, math.inf)
    exact = torch.zeros(gap.shape[-2:], dtype=torch.bool)
    for i, j in case.exact_pairs:
        exact[i, j] = exact[j, i] = True
    return gap, exact


def _comparable_rows(case: Case, distance: str, scales=(1.0,)) -> torch.Tensor:
    """Defined rows whose selected/unselected distance pairs are not near ties at any scale.

    A near tie is a pair whose distances differ by less than :data:`NEAR_TIE` (relative to the
    row's scale) without being an exact tie of identical contributions; two computations that
    round differently may order it either way. Exact ties are kept: the SPEC's tie rules apply
    to them, and identical inputs must give identical distances. At several scales the pairs
    must also be ordered the same way at all of them (the cosine η does not scale; for the
    Euclidean distance this always holds in exact arithmetic).
    """
    ok = case.defined()
    signs = None
    for scale in scales:
        gap, exact = _pair_gaps(case, distance, scale)
        near = (gap.abs() <= NEAR_TIE) & ~exact
        ok = ok & ~near.flatten(-2).any(-1)
        sign = torch.where(exact, 0.0, torch.sign(torch.where(gap.isinf(), 0.0, gap)))
        if signs is not None:
            ok = ok & (sign == signs).flatten(-2).all(-1)
        signs = sign
    return ok


def _row_scale(case: Case) -> torch.Tensor:
    """``max‖y‖ + ‖s‖`` per row: the unit of absolute errors of Euclidean distances and γ."""
    _, scale_sq = _direct_distances(case, "euclidean")
    return scale_sq.sqrt()


def _assert_same(
    a: F.Separability, b: F.Separability, rows: torch.Tensor, margin_atol, what: str
) -> None:
    """Counts-based figures equal exactly on ``rows``; margins within ``margin_atol``."""
    for m in ("precision", "recall", "f_score", "inversions"):
        x, y = getattr(a, m)[rows], getattr(b, m)[rows]
        assert torch.equal(x, y), f"{what} {m}: {x.tolist()} != {y.tolist()}"
    x, y = a.margin[rows], b.margin[rows]
    tol = margin_atol[rows] if isinstance(margin_atol, torch.Tensor) else margin_atol
    assert ((x - y).abs() <= tol).all(), f"{what} margin: {x.tolist()} != {y.tolist()}"


def _margin_tol(case: Case, distance: str) -> torch.Tensor | float:
    # Euclidean γ inherits the factored distance's absolute error, about sqrt(ulp)·scale near
    # zero distance; cosine distances are accurate to a few ulp.
    return 1e-6 * _row_scale(case) + 1e-12 if distance == "euclidean" else 1e-9


# ---------------------------------------------------------------------------------------------
# 1-2. inversion certificates; margin / inversions / perfect-score equivalence
# ---------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(case=cases())
def test_inversion_certificates(case):
    """``P ≥ N/(N+GInv)`` and ``R ≥ max(0, 1 − GInv/N)`` (SPEC §3, both distances).

    Every unselected key inside the closed outer ball is an inversion with the farthest selected
    key, and every selected key outside the strict inner ball is one with the nearest unselected.
    """
    rows = case.defined()
    assume(rows.any())
    n = float(case.n)
    slack = 1e-12  # the certificates are ratios of the same integers: equality up to one rounding
    for distance in DISTANCES:
        r = case.run(distance)
        p, rec, ginv = r.precision[rows], r.recall[rows], r.inversions[rows]
        assert (p >= n / (n + ginv) - slack).all(), (distance, p, ginv)
        assert (rec >= (1 - ginv / n).clamp_min(0) - slack).all(), (distance, rec, ginv)


@PROPERTY_SETTINGS
@given(case=cases())
def test_margin_inversions_perfect_scores_equivalent(case):
    """``γ > 0 ⇔ GInv = 0 ⇔ P = R = F = 1`` exactly, as computed (SPEC §3).

    With the closed outer ball and the strict inner ball, ``γ = ρ_min − ρ_max ≤ 0`` means the
    nearest unselected key is contamination *and* the farthest selected key is not recalled, so
    then ``P < 1`` and ``R < 1`` separately — a distance tie (γ = 0) included.
    """
    rows = case.defined()
    assume(rows.any())
    for distance in DISTANCES:
        r = case.run(distance)
        margin, ginv = r.margin[rows], r.inversions[rows]
        p, rec, f = r.precision[rows], r.recall[rows], r.f_score[rows]
        perfect = (p == 1) & (rec == 1) & (f == 1)
        assert torch.equal(margin > 0, ginv == 0), (distance, margin, ginv)
        assert torch.equal(ginv == 0, perfect), (distance, ginv, p, rec, f)
        assert ((p < 1) & (rec < 1))[margin <= 0].all(), (distance, margin, p, rec)


# ---------------------------------------------------------------------------------------------
# 3. Euclidean N = 1
# ---------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(case=cases(exact_ties=False), data=st.data())
def test_euclidean_singleton_is_perfectly_separable(case, data):
    """Euclidean ``N = 1``: ``F_1 = 1`` for any singleton selection (SPEC §3, the trivial case).

    The selected key is its own aggregate (``D_i = 0``) and every other key is strictly farther —
    provided no other key has the *same* contribution ``y_j = y_i``. That is the real condition;
    ``α_i > 0`` is not needed (with ``α_i = 0``, ``s = 0`` and ``D_j = ‖y_j‖ > 0`` whenever
    ``y_j ≠ 0``). Equal contributions are an exact tie that the SPEC's rules count against the
    selection (see the exact-tie test below), so they are excluded here, and so are pairs of
    contributions within ``1e-6`` of each other: the factored ``D_i`` of the selected key is not
    an exact zero but a rounding residue of about ``1e-8·scale``.
    """
    k = case.n_keys
    i = data.draw(st.integers(0, k - 1), label="selected_key")
    mask = case.mask().clone()
    mask[..., i] = True
    alpha = case.alpha.double().clone()
    # Give the selected key a positive α even where the generated row had masked it out (not
    # needed for the theorem, see above, but it keeps y_i away from the other keys' zeros).
    alpha[..., i] = torch.where(alpha[..., i] == 0, 1.0 / k, alpha[..., i])
    selected = torch.zeros_like(mask)
    selected[..., i] = True
    single = replace(case, alpha=alpha, key_mask=mask, n=1, selected=selected)
    dist, scale_sq = _direct_distances(single, "euclidean")
    others = mask.clone()
    others[..., i] = False
    separated = torch.where(others, dist, math.inf).amin(-1) > 1e-6 * scale_sq.sqrt()
    rows = single.defined() & separated
    assume(rows.any())
    r = single.run("euclidean")
    assert (r.f_score[rows] == 1).all(), (r.f_score, rows)
    assert (r.precision[rows] == 1).all() and (r.recall[rows] == 1).all()
    assert (r.inversions[rows] == 0).all() and (r.margin[rows] > 0).all()


@PROPERTY_SETTINGS
@given(case=cases(exact_ties=True), data=st.data())
def test_singleton_with_an_identical_twin_is_a_tie(case, data):
    """``N = 1`` on a key whose contribution another valid key shares exactly.

    Both distances to the aggregate are equal (zero for Euclidean), so by SPEC §3 the twin is
    contamination (closed ball) and the selected key is not recalled (strict ball): ``R = 0``,
    ``F = 0``, ``γ ≤ 0`` (``= 0`` for Euclidean, up to the rounding residue of the selected
    key's own distance) — for any key order. Exact arithmetic gives an exact tie here
    (``_types.COMPUTE_DTYPE``: "float64 keeps exact ties (duplicated vectors) exact").
    """
    src, dst = case.exact_pairs[data.draw(st.integers(0, len(case.exact_pairs) - 1), label="pair")]
    i = data.draw(st.sampled_from([src, dst]), label="selected_twin")
    selected = torch.zeros(case.alpha.shape, dtype=torch.bool)
    selected[..., i] = True
    single = replace(case, n=1, selected=selected)
    rows = single.defined()
    assume(rows.any())
    for distance in DISTANCES:
        r = single.run(distance)
        assert (r.recall[rows] == 0).all() and (r.f_score[rows] == 0).all(), (distance, r, rows)
        assert (r.margin[rows] <= 0).all(), (distance, r.margin)
        assert (r.precision[rows] < 1).all() and (r.inversions[rows] >= 1).all(), (distance, r)


def test_identical_contributions_tie_minimal_example():
    """Regression: the smallest input found that split an exact tie (5 keys, d = 5).

    Keys 0 and 4 have the same α and the same v, key 0 is selected (N = 1). SPEC §3 (and the
    NumPy reference of tests/reference.py) give P = 1/2, R = 0, F = 0, γ = 0, GInv = 1. Before
    the inner products were read from each key's first duplicate, the BLAS product rounded
    ``⟨v_4, s⟩`` differently from ``⟨v_0, s⟩`` (an edge-kernel column) and this scored F = 1.
    """
    alpha = torch.full((5,), 0.2, dtype=torch.float64)
    values = torch.tensor(
        [
            [0.5, 0.4, 0.5, 0.3, 0.4],
            [0.6, 0.9, 0.5, 0.7, 0.1],
            [0.5, 0.9, 0.3, 0.5, 0.5],
            [0.8, 0.3, 0.5, 0.1, 0.9],
            [0.5, 0.4, 0.5, 0.3, 0.4],
        ],
        dtype=torch.float64,
    )
    selected = torch.tensor([True, False, False, False, False])
    dist = F.distances(alpha, values, selected)
    assert dist[0] == dist[4], dist.tolist()
    r = F.separability(alpha, values, 1, selected=selected)
    assert (r.precision.item(), r.recall.item(), r.f_score.item()) == (0.5, 0.0, 0.0), r
    assert (r.margin.item(), r.inversions.item()) == (0.0, 1.0), r


@PROPERTY_SETTINGS
@given(case=cases(exact_ties=True))
def test_identical_contributions_have_identical_distances(case):
    """Two keys with the same ``α`` and ``v`` are at exactly the same distance from any aggregate.

    The root of the exact-tie properties: the tie rules of SPEC §3 only mean something if equal
    contributions give bit-identical ``D``.
    """
    sel = case.selection()
    for distance in DISTANCES:
        dist = F.distances(case.alpha, case.values, sel, distance)
        for src, dst in case.exact_pairs:
            assert torch.equal(dist[..., src], dist[..., dst]), (distance, src, dst, dist)


# ---------------------------------------------------------------------------------------------
# 4. permutation invariance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exact_ties", [False, True], ids=["no_exact_ties", "exact_ties"])
@COMPARISON_SETTINGS
@given(data=st.data())
def test_permutation_invariance_explicit_selection(data, exact_ties):
    """Permuting keys with their α, v, mask and selection changes no figure (SPEC §3)."""
    case = data.draw(cases(selection="random", exact_ties=exact_ties), label="case")
    perm = data.draw(st.permutations(range(case.n_keys)), label="perm")
    moved = case.permuted(perm)
    rows = {d: _comparable_rows(case, d) & _comparable_rows(moved, d) for d in DISTANCES}
    assume(any(r.any() for r in rows.values()))
    for d in DISTANCES:
        _assert_same(case.run(d), moved.run(d), rows[d], _margin_tol(case, d), d)


@COMPARISON_SETTINGS
@given(data=st.data())
def test_permutation_invariance_top_n_without_boundary_ties(data):
    """Top-N: permuting keys changes nothing in the rows whose top-N set is unique.

    The set is unique when the N-th and (N+1)-th largest valid α differ; elsewhere the lower-index
    tie-break depends on the key order (see the tie-order test below).
    """
    case = data.draw(cases(selection="top", exact_ties=False), label="case")
    perm = data.draw(st.permutations(range(case.n_keys)), label="perm")
    moved = case.permuted(perm)
    alpha = torch.where(case.mask(), case.alpha.double(), -math.inf)
    top = alpha.sort(-1, descending=True).values
    n = case.n  # 1 ≤ n < key count here
    unique = top[..., n - 1] > top[..., n]
    # The top-N sets themselves are the permuted ones wherever they are unique.
    want = case.selection()[..., torch.tensor(perm)]
    got = moved.selection()
    assert torch.equal(got[unique], want[unique])
    rows = {d: unique & _comparable_rows(case, d) & _comparable_rows(moved, d) for d in DISTANCES}
    assume(any(r.any() for r in rows.values()))
    for d in DISTANCES:
        _assert_same(case.run(d), moved.run(d), rows[d], _margin_tol(case, d), d)


@COMPARISON_SETTINGS
@given(data=st.data())
def test_permutation_invariance_top_n_keeping_tie_order(data):
    """Top-N with attention ties: a permutation that keeps tied keys in their relative order
    ("permuting keys ... and the tie order", SPEC §3) selects the same keys and changes nothing.

    The permutation is made per row (tie groups differ between rows), so the values are
    expanded to one block per row here.
    """
    case = data.draw(cases(selection="top", exact_ties=False), label="case")
    k = case.n_keys
    alpha = torch.where(case.mask(), case.alpha.double(), -math.inf)
    flat = alpha.reshape(-1, k)
    perms = []
    for row in flat:
        perm = list(data.draw(st.permutations(range(k)), label="perm"))
        for level in row.unique():  # keys of one α level keep their index order
            group = [key for key in range(k) if row[key] == level]
            slots = [pos for pos, key in enumerate(perm) if row[key] == level]
            for pos, key in zip(slots, sorted(group)):
                perm[pos] = key
        perms.append(perm)
    index = torch.tensor(perms).reshape(alpha.shape)
    values = case.values.expand(*case.alpha.shape, case.values.shape[-1])
    expanded = replace(case, values=values)
    moved = replace(
        case,
        alpha=case.alpha.gather(-1, index),
        values=values.gather(-2, index[..., None].expand_as(values)),
        key_mask=None if case.key_mask is None else case.key_mask.gather(-1, index),
        exact_pairs=(),
    )
    assert torch.equal(moved.selection(), expanded.selection().gather(-1, index))
    rows = {d: _comparable_rows(expanded, d) & _comparable_rows(moved, d) for d in DISTANCES}
    assume(any(r.any() for r in rows.values()))
    for d in DISTANCES:
        _assert_same(expanded.run(d), moved.run(d), rows[d], _margin_tol(case, d), d)


# ---------------------------------------------------------------------------------------------
# 5. scale invariance
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("exact_ties", [False, True], ids=["no_exact_ties", "exact_ties"])
@COMPARISON_SETTINGS
@given(data=st.data())
def test_scale_invariance(data, exact_ties):
    """``v → c·v`` (``c > 0``): Euclidean P, R, F, GInv unchanged and γ → c·γ; cosine unchanged.

    Only ``float64`` values are scaled (``c·v`` of a float32 tensor would round differently per
    key). For the cosine distance the η of SPEC §3 does not scale, so the invariance is exact only
    up to η; rows where η reorders a selected/unselected pair, or leaves a near tie, are skipped
    (:func:`_comparable_rows` with both scales).
    """
    case = data.draw(cases(exact_ties=exact_ties), label="case")
    c = data.draw(st.floats(0.1, 10.0, allow_nan=False), label="c")
    case = replace(case, values=case.values.double(), alpha=case.alpha.double())
    scaled = replace(case, values=case.values * c)
    rows = {d: _comparable_rows(case, d, scales=(1.0, c)) for d in DISTANCES}
    assume(any(r.any() for r in rows.values()))
    r1, rc = case.run("euclidean"), scaled.run("euclidean")
    tol = _margin_tol(case, "euclidean") * max(c, 1.0)
    _assert_same(r1._replace(margin=r1.margin * c), rc, rows["euclidean"], tol, "euclidean")
    r1, rc = case.run("cosine"), scaled.run("cosine")
    dist1, _ = _direct_distances(case, "cosine")
    distc, _ = _direct_distances(case, "cosine", c)
    eta_shift = (dist1 - distc).abs().amax(-1)  # what η itself moves γ by, at most 2×
    _assert_same(r1, rc, rows["cosine"], 1e-9 + 2 * eta_shift, "cosine")


# ---------------------------------------------------------------------------------------------
# 6. bounds and NaN
# ---------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(case=cases(n_in_range=False))
def test_bounds_and_nan_exactly_outside_range(case):
    """``0 < P ≤ 1`` (and ``P ≥ N/|T|``), ``0 ≤ R ≤ 1``, ``F ∈ [0, 1]`` the harmonic mean
    (0 iff R = 0), ``GInv ∈ [0, N(|T|−N)]`` an integer, γ finite — and every figure NaN exactly
    where ``N`` is outside ``1 ≤ N < |valid keys|`` (SPEC §2-3)."""
    defined = case.defined()
    n = float(case.n)
    n_valid = case.mask().sum(-1)[defined].double()
    for distance in DISTANCES:
        r = case.run(distance)
        for m in METRICS:
            x = getattr(r, m)
            assert x.shape == defined.shape, (distance, m, x.shape)
            assert x.dtype == torch.float64
            assert torch.equal(torch.isnan(x), ~defined), (distance, m, x, defined)
        p, rec, f = r.precision[defined], r.recall[defined], r.f_score[defined]
        ginv, margin = r.inversions[defined], r.margin[defined]
        assert ((p > 0) & (p <= 1)).all() and (p >= n / n_valid - 1e-12).all(), (distance, p)
        assert ((rec >= 0) & (rec <= 1)).all(), (distance, rec)
        assert ((f >= 0) & (f <= 1)).all(), (distance, f)
        assert torch.equal(f == 0, rec == 0), (distance, f, rec)
        harmonic = torch.where(rec > 0, 2 * p * rec / (p + rec), 0.0)
        torch.testing.assert_close(f, harmonic, rtol=1e-12, atol=0)
        assert ((ginv >= 0) & (ginv <= n * (n_valid - n))).all(), (distance, ginv, n_valid)
        assert torch.equal(ginv, ginv.round()), (distance, ginv)
        # Counts are multiples of 1/N: P = N/(N+C), R = recalled/N with integer C and recalled.
        assert torch.allclose(n / p - n, (n / p - n).round(), atol=1e-9), (distance, p)
        assert torch.allclose(rec * n, (rec * n).round(), atol=1e-9), (distance, rec)
        assert torch.isfinite(margin).all(), (distance, margin)


# ---------------------------------------------------------------------------------------------
# batch layout (values broadcast over queries) against one row at a time
# ---------------------------------------------------------------------------------------------


@COMPARISON_SETTINGS
@given(case=cases(exact_ties=False))
def test_batched_rows_equal_one_row_at_a_time(case):
    """The vectorised call (values broadcast as ``[rows, 1, key, d]``) scores every row as the
    same call on that row alone with its own ``[key, d]`` values block."""
    rows_ok = {d: _comparable_rows(case, d) for d in DISTANCES}
    assume(any(r.any() for r in rows_ok.values()))
    lead = case.alpha.shape[:-1]
    values = case.values.expand(*lead, *case.values.shape[-2:])
    mask = case.mask()
    sel = case.selection()
    for distance in DISTANCES:
        batched = case.run(distance)
        tol = _margin_tol(case, distance)
        for at in itertools.product(*[range(s) for s in lead]):
            if not rows_ok[distance][at]:
                continue
            one = F.separability(
                case.alpha[at], values[at], case.n, key_mask=mask[at], selected=sel[at],
                distance=distance,
            )
            for m in ("precision", "recall", "f_score", "inversions"):
                assert getattr(one, m) == getattr(batched, m)[at], (distance, m, at, one, batched)
            t = tol[at] if isinstance(tol, torch.Tensor) else tol
            assert abs(one.margin - batched.margin[at]) <= t, (distance, at, one, batched)


# ---------------------------------------------------------------------------------------------
# 7. random subsets
# ---------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    lead=st.lists(st.integers(1, 3), min_size=0, max_size=2),
    k=st.integers(1, 12),
    samples=st.integers(1, 5),
    p_valid=st.sampled_from([0.3, 0.7, 1.0]),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_subsets_exact_size_valid_and_nested(lead, k, samples, p_valid, seed):
    """``random_ranks(mask, R, g) < N`` holds exactly ``N`` keys, all valid, for every sample
    and every ``N ≤ |valid|``; the subsets grow by one key per ``N`` (nested prefixes); the
    valid keys take the ranks ``0 .. |valid|−1``; the same seed gives the same ranks."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(*lead, k, generator=g) < p_valid
    ranks = F.random_ranks(mask, samples, torch.Generator().manual_seed(seed + 1))
    again = F.random_ranks(mask, samples, torch.Generator().manual_seed(seed + 1))
    assert torch.equal(ranks, again)
    assert ranks.shape == (*lead, samples, k)
    valid = mask.unsqueeze(-2).expand_as(ranks)
    n_valid = mask.sum(-1).unsqueeze(-1)  # [*lead, 1]
    # Every sample is a permutation of 0..k-1 with the valid keys first.
    assert torch.equal(ranks.sort(-1).values, torch.arange(k).expand_as(ranks))
    assert (torch.where(valid, ranks, -1).amax(-1) == n_valid - 1).all()
    previous = torch.zeros_like(valid)
    for n in range(k + 1):
        subset = ranks < n
        size = subset.sum(-1)
        in_range = n <= n_valid
        assert (size == n).all()  # a permutation: exactly n keys for every n
        # ... and only valid ones while n ≤ |valid| (afterwards all valid keys are in).
        assert (~(subset & ~valid)).all(-1)[in_range.expand_as(size)].all()
        assert ((subset & valid).sum(-1) == torch.minimum(torch.tensor(n), n_valid)).all()
        assert (previous <= subset).all() and ((subset & ~previous).sum(-1) == min(n, 1)).all()
        previous = subset
