"""SPEC §6: inversion certificates, the sink-aware constant-norm regime bound, diagnostics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import tl_geometry
import tl_geometry.functional as F
from tl_geometry.functional.bounds import RegimeParams

SLACK = 1e-12  # measured and bound are both float64; compare with a hair of tolerance


def _params(**kw: float) -> RegimeParams:
    return RegimeParams(*(torch.tensor(kw[f], dtype=torch.float64) for f in RegimeParams._fields))


@st.composite
def heads(draw):
    """A head's attention rows and values: ties, a compressed anti-aligned sink, MQA sharing."""
    n_key = draw(st.integers(2, 10))
    d = draw(st.integers(1, 5))
    rows = draw(st.integers(1, 3))  # query heads sharing one KV head (MQA)
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(n_key, d, generator=g, dtype=torch.float64)
    if draw(st.booleans()):  # few directions, with signs: the bounds are nearly tight there
        base = torch.randn(draw(st.integers(1, 2)), d, generator=g, dtype=torch.float64)
        pick = torch.randint(base.shape[0], (n_key,), generator=g)
        sign = torch.randint(0, 2, (n_key, 1), generator=g).double() * 2 - 1
        v = base[pick] * sign * (1 + 0.01 * torch.rand(n_key, 1, generator=g, dtype=torch.float64))
    if draw(st.booleans()):  # near-constant norms: the regime the bound is made for
        v = v / v.norm(dim=-1, keepdim=True) * (1 + 0.1 * torch.rand(n_key, 1, generator=g, dtype=torch.float64))
    if draw(st.booleans()) and n_key > 2:  # compressed sink pointing against the rest
        v[0] = -0.2 * v[1:].mean(0)
    if draw(st.booleans()) and n_key > 3:  # duplicated key
        v[3] = v[1]
    logits = torch.randn(rows, n_key, generator=g, dtype=torch.float64) * draw(st.sampled_from([0.5, 2.0, 6.0]))
    if draw(st.booleans()):
        logits = logits.round()  # exact attention ties
    return torch.softmax(logits, -1), v


@settings(max_examples=300, deadline=None)
@given(case=heads(), data=st.data())
def test_measured_never_below_any_certificate(case, data):
    alpha, v = case
    n = data.draw(st.integers(1, alpha.shape[-1] - 1))
    measured = F.separability(alpha, v, n)
    certificates = [
        F.inversion_bounds(n, measured.inversions),
        F.regime_bounds(alpha, F.fit_regime(v, torch.tensor(0), mode="certificate"), n, sink=0),
    ]
    for bound in certificates:
        assert (measured.precision >= bound.precision - SLACK).all(), (measured, bound)
        assert (measured.recall >= bound.recall - SLACK).all(), (measured, bound)
        assert (measured.f_score >= bound.f_score - SLACK).all(), (measured, bound)


def test_regime_bound_tight_on_a_line_with_a_tie():
    """All values equal (c = σ = 1, δ = 0, κ = 1): every bound is the exact distance.

    α = (3/8, 3/8, 1/8, 1/8), ν = 2 ⇒ a = (3/4, 3/4, 1/4, 1/4). N = 1 selects key 0; s = a_0.
    D_0 = 0 and D_1 = |3/4 − 3/4| = 0 (a tie: contamination, not recall), D_2 = D_3 = 1/2.
    Measured and bound alike: P = 1/(1+1) = 1/2, R = 0, F = 0.
    """
    alpha = torch.tensor([0.375, 0.375, 0.125, 0.125], dtype=torch.float64)
    v = torch.tensor([[2.0, 0.0]] * 4, dtype=torch.float64)
    params = _params(nu=2, delta=0, kappa_lo=1, kappa_hi=1, c_lo=1, c_hi=1, sigma_lo=1, sigma_hi=1)
    bound = F.regime_bounds(alpha, params, 1, sink=0)
    measured = F.separability(alpha, v, 1)
    assert (float(bound.precision), float(bound.recall), float(bound.f_score)) == (0.5, 0.0, 0.0)
    assert (float(measured.precision), float(measured.recall)) == (0.5, 0.0)
    # Orthogonal values of equal norm: the bound is exact too, and here perfect (1, 1, 1).
    eye = torch.eye(4, dtype=torch.float64)
    ortho = _params(nu=1, delta=0, kappa_lo=1, kappa_hi=1, c_lo=0, c_hi=0, sigma_lo=0, sigma_hi=0)
    for n in (1, 2, 3):
        b, m = F.regime_bounds(alpha, ortho, n, sink=0), F.separability(alpha, eye, n)
        assert float(b.f_score) == float(m.f_score) == 1.0


def test_regime_bound_vacuous_with_antiparallel_values():
    """c ∈ [−1, 1] lets the selected pair cancel: nothing can be certified.

    Keys: sink u; w, w, −w; z, −z (u, w, z orthonormal), α = (.05, .3, .3, .15, .1, .1), N = 2
    selects {1, 2}. LB‖s‖² = a₁² + a₂² − 2a₁a₂ = 0, so every unselected LB(D_j) ≤ a_j ≤
    UB(D_i) = a₂ = 0.3: all four are counted as contamination ⇒ P̲ = 2/6, R̲ = 0, F̲ = 0.
    Measured: D_1 = D_2 = 0.3 and every unselected D_j ≥ 0.6 ⇒ P = R = F = 1.
    """
    u, w, z = torch.eye(3, dtype=torch.float64)
    v = torch.stack([u, w, w, -w, z, -z])
    alpha = torch.tensor([0.05, 0.3, 0.3, 0.15, 0.1, 0.1], dtype=torch.float64)
    params = F.fit_regime(v, torch.tensor(0))
    assert params.c_lo < -0.999 and params.c_hi > 0.999
    bound = F.regime_bounds(alpha, params, 2, sink=0)
    assert math.isclose(float(bound.precision), 1 / 3) and float(bound.recall) == 0.0
    measured = F.separability(alpha, v, 2)
    assert float(measured.f_score) == 1.0


def test_inversion_bounds_worked_example():
    b = F.inversion_bounds(torch.tensor([2, 2, 4]), torch.tensor([0.0, 1.0, 2.0]))
    assert b.precision.tolist() == [1.0, 2 / 3, 4 / 6]
    assert b.recall.tolist() == [1.0, 0.5, 0.5]
    assert torch.isnan(F.inversion_bounds(2, torch.tensor(float("nan"))).recall)


def test_regime_fit_recovers_known_parameters():
    """Values built with ν = 3, κ = 0.2 and cos(v_i, v_j) ≈ exp(−λ|i−j|), λ = −ln 0.8."""
    g = torch.Generator().manual_seed(0)
    n_key, d, rho, nu, kappa = 64, 4096, 0.8, 3.0, 0.2
    u = torch.zeros(n_key, d, dtype=torch.float64)
    u[0] = torch.randn(d, generator=g, dtype=torch.float64)
    for t in range(1, n_key):  # AR(1) in high dimension: correlation ρ^lag
        u[t] = rho * u[t - 1] + math.sqrt(1 - rho**2) * torch.randn(d, generator=g, dtype=torch.float64)
    v = u / u.norm(dim=-1, keepdim=True) * nu
    v[0] = -v[1:].mean(0) / v[1:].mean(0).norm() * kappa * nu
    params = F.fit_regime(v, torch.tensor(0))
    assert math.isclose(float(params.nu), nu, rel_tol=1e-6) and float(params.delta) < 1e-6
    assert math.isclose(float(params.kappa_lo), kappa, rel_tol=1e-6)
    assert float(params.sigma_hi) < 0  # the sink points against the rest
    diag = F.regime_diagnostics(v, torch.tensor(0))
    assert abs(float(diag.decay) - (-math.log(rho))) < 0.02
    assert abs(float(diag.a) - 1) < 0.05 and abs(float(diag.b)) < 0.05
    assert float(diag.norm_cv) < 1e-9 and math.isclose(float(diag.kappa), kappa, rel_tol=1e-6)
    assert float(diag.fit_mae) < 0.05
    predicted = F.fit_regime(v, torch.tensor(0), mode="predict")
    assert params.c_lo <= predicted.c_lo <= predicted.c_hi <= params.c_hi


def test_certificates_hold_on_real_smollm2(smollm2):
    """Every head, every N, every query of three real layers; then the analysis means."""
    n_heads, n_kv = 9, 3
    kv = F.kv_head_index(n_heads, n_kv)
    for layer in (0, 12, 29):
        pattern = smollm2.cache[f"blocks.{layer}.attn.hook_pattern"].double()
        v = smollm2.cache[f"blocks.{layer}.attn.hook_v"].double().permute(0, 2, 1, 3)[:, kv]
        params = F.fit_regime(v, torch.tensor(0))  # [batch, head]
        params = RegimeParams(*(x[:, :, None] for x in params))
        mask = F.causal_key_mask(pattern.shape[-1])
        for n in (1, 2, 4, 8, 16):
            measured = F.separability(pattern, v[:, :, None], n, key_mask=mask)
            regime = F.regime_bounds(pattern, params, n, sink=0, key_mask=mask)
            inversion = F.inversion_bounds(n, measured.inversions)
            for bound in (regime, inversion):
                for m in ("precision", "recall", "f_score"):
                    got, low = getattr(measured, m), getattr(bound, m)
                    ok = torch.isnan(got) | (got >= low - SLACK)
                    assert ok.all(), (layer, n, m)
    result = tl_geometry.analyze_heads(smollm2.cache, n_values=(1, 2, 4, 8), bounds=True, queries="all",
                                       random_samples=2)
    for kind in ("inversion", "certified", "shell", "shell_n"):
        for m in ("precision", "recall", "f_score"):
            assert (result.metric(m) >= result.bound(kind, m) - 1e-9).all(), (kind, m)
    assert (result.shell_n_separated <= result.inversion_separated + 1e-12).all()
    assert result.certified_fraction.shape == (4,)
    assert result.headline_n == (2, 4, 8)  # 40 positions: N ≤ 10
    best = result.best_n()
    for column in ("measured_best_n", "shell_best_n", "shell_n_best_n", "predicted_best_n"):
        assert set(best[column].dropna()) <= {2, 4, 8}, column
    assert torch.isfinite(result.regime_diagnostic("decay")).all()


def test_bounds_option_validation_and_roundtrip(tmp_path):
    from cases import make_case

    case = make_case(3, sink=True)
    with pytest.raises(ValueError, match="euclidean"):
        tl_geometry.analyze_heads(case.cache(), bounds=True, distance="cosine")
    result = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2, 3), bounds=True, random_samples=2)
    frame = result.to_pandas()
    assert {"bound_inversion", "bound_certified", "bound_predicted", "bound_shell", "bound_shell_n"} <= set(frame.group)
    assert "separated" in frame.columns
    loaded = tl_geometry.HeadAnalysis.load(result.save(tmp_path / "r.pt"))
    assert torch.equal(loaded.bounds.nan_to_num(), result.bounds.nan_to_num())
    assert torch.equal(loaded.regime.nan_to_num(), result.regime.nan_to_num())
    assert "certified" in result.summary()
    plain = tl_geometry.analyze_heads(case.cache(), n_values=(1, 2, 3), random_samples=2)
    assert plain.bounds is None
    torch.testing.assert_close(plain.scores, result.scores, equal_nan=True)
    with pytest.raises(AttributeError, match="bounds=True"):
        _ = plain.certified_f_score


def test_degenerate_regime_certifies_nothing_wrong():
    """All non-sink values zero (ν = 0): the 'certificate' must still not exceed the measure."""
    v = torch.tensor([[1.0, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]], dtype=torch.float64)
    alpha = torch.tensor([0.1, 0.5, 0.3, 0.1], dtype=torch.float64)
    measured = F.separability(alpha, v, 2)
    bound = F.regime_bounds(alpha, F.fit_regime(v, 0), 2, sink=0)
    assert float(measured.precision) >= float(bound.precision)
    assert float(measured.recall) >= float(bound.recall)


def test_undefined_n_gives_nan_bounds_not_zero():
    b = F.inversion_bounds(2, torch.tensor([float("nan"), 1.0]))
    assert torch.isnan(b.f_score[0]) and float(b.f_score[1]) == pytest.approx(2 * (2 / 3) * 0.5 / (2 / 3 + 0.5))


def _diagnostics_per_pair(v: torch.Tensor, sink: int, key_mask: torch.Tensor, pairs) -> list[float]:
    """Regime diagnostics of one head, fitted pair by pair (the slow, obvious form of SPEC §6c)."""
    keys = [k for k in range(v.shape[0]) if key_mask[k] and k != sink]
    norms = torch.stack([v[k].norm() for k in keys])
    data = [(abs(i - j), float(v[i] @ v[j] / (v[i].norm() * v[j].norm())))
            for i, j in pairs if i in keys and j in keys]
    lags = np.array([lag for lag, _ in data], dtype=np.float64)
    ys = np.array([c for _, c in data])
    best = None
    for lam in F.regime.DECAY_GRID.tolist():  # closed-form line fit of y on x = exp(−λ·lag)
        xs = np.exp(-lam * lags)
        n, sx, sy = len(xs), xs.sum(), ys.sum()
        det = n * (xs * xs).sum() - sx * sx
        a = (n * (xs * ys).sum() - sx * sy) / det if abs(det) > 1e-12 else 0.0
        b = (sy - a * sx) / n
        residual = ys - a * xs - b
        sse = float((residual**2).sum())
        if best is None or sse < best[0] - 1e-12:
            best = (sse, a, lam, b, float(np.abs(residual).mean()))
    _, a, lam, b, mae = best
    mean = float(norms.mean())
    return [float(norms.std(unbiased=False)) / mean, float(v[sink].norm()) / mean, a, lam, b, mae]


@pytest.mark.parametrize("n_key", [40, 600])  # every pair, and sampled pairs (beyond MAX_PAIRS)
def test_regime_diagnostics_equal_a_per_pair_fit(n_key):
    """The lag-aggregated fit equals the per-pair least squares, with masked keys and a sink."""
    g = torch.Generator().manual_seed(1)
    d = 8
    drift = torch.cumsum(torch.randn(n_key, d, generator=g, dtype=torch.float64), 0) / 4
    v = drift + torch.randn(n_key, d, generator=g, dtype=torch.float64)
    key_mask = torch.rand(n_key, generator=g) > 0.1
    key_mask[3] = True
    stats = F.bounds.pair_stats(v, 3, key_mask)
    diag = F.regime.diagnostics_from_pairs(stats)
    n_pairs = stats.lag.numel()
    if n_key * (n_key - 1) // 2 > F.bounds.MAX_PAIRS:  # re-draw the documented sample
        gen = torch.Generator().manual_seed(0)
        i = torch.randint(n_key, (n_pairs,), generator=gen)
        j = (i + torch.randint(1, n_key, (n_pairs,), generator=gen)) % n_key
    else:
        i, j = torch.triu_indices(n_key, n_key, offset=1)
    assert torch.equal(stats.lag, (i - j).abs().double())
    expected = _diagnostics_per_pair(v, 3, key_mask, list(zip(i.tolist(), j.tolist())))
    for got, want in zip(diag, expected):
        assert math.isclose(float(got), want, rel_tol=1e-7, abs_tol=1e-9), (diag, expected)
