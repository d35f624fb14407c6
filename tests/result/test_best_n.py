"""SPEC §3 / §6d: the headline range ``2 ≤ N ≤ (t+1)/4`` and a head's best N over it."""

from __future__ import annotations

import math

import pytest
import torch
from result_fakes import fake

from tl_geometry.result.schema import names

NAN = math.nan


def _result(**metadata):
    return fake(layers=(0,), n_heads=5, n_values=(1, 2, 4, 8, 16), bounds=True,
                metadata={"n_positions": 48, **metadata})


def test_headline_range():
    assert _result().headline_n == (2, 4, 8)  # 48 positions: N ≤ 12
    assert _result(n_positions=64).headline_n == (2, 4, 8, 16)  # the bound is inclusive
    assert _result(n_positions=7).headline_n == ()
    assert fake(n_values=(1, 2, 4, 8)).headline_n == (2, 4, 8)  # length unknown: every N ≥ 2


def test_best_n_is_the_argmax_over_the_headline_range_and_undefined_is_nan():
    r = _result()
    f = torch.tensor([
        [0.99, 0.2, 0.5, 0.4, 0.9],  # N = 1 and N = 16 lie outside: best 4
        [NAN, NAN, NAN, NAN, 0.7],  # nothing defined in range: NaN, not 2
        [1.0, 0.3, 0.3, 0.1, NAN],  # a tie: the smaller N
        [1.0, NAN, 0.1, 0.6, NAN],  # NaN is skipped
        [1.0, 0.0, 0.0, 0.0, 0.0],  # measured zeros are values (SPEC: only a bound's 0 is "none")
    ], dtype=torch.float64)
    metric, kind = names()["metric"].index, names()["bound_kind"].index
    r.scores[0, metric("f_score"), 0] = f  # group top
    shell = f.clone()
    shell[4] = 0.0  # a bound that certifies nothing anywhere: undefined
    shell[0] = torch.tensor([0.5, 0.0, 0.0, 0.3, 0.0])  # zeros are ignored, the 0.3 is a value
    r.bounds[kind("shell"), 2, 0] = shell  # metric f_score
    r.bounds[kind("shell_n"), 2, 0] = f
    best = r.best_n()
    assert list(best.columns) == ["layer", "head", "measured_best_n", "shell_best_n",
                                  "shell_n_best_n", "predicted_best_n"]
    torch.testing.assert_close(torch.tensor(best.measured_best_n.to_numpy()),
                               torch.tensor([4.0, NAN, 2.0, 8.0, 2.0], dtype=torch.float64), equal_nan=True)
    torch.testing.assert_close(torch.tensor(best.shell_best_n.to_numpy()),
                               torch.tensor([8.0, NAN, 2.0, 8.0, NAN], dtype=torch.float64), equal_nan=True)
    torch.testing.assert_close(torch.tensor(best.shell_n_best_n.to_numpy()),
                               torch.tensor([4.0, NAN, 2.0, 8.0, NAN], dtype=torch.float64), equal_nan=True)
    # Agreement over heads where both are defined: shell_n agrees on 3 of 3, shell on 2 of 3.
    assert r.best_n_agreement("shell_n") == 1.0
    assert r.best_n_agreement("shell") == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="unknown bound kind 'inversion'"):
        r.best_n_agreement("inversion")


def test_best_n_with_an_empty_headline_range_is_undefined():
    best = _result(n_positions=7).best_n()
    assert best.drop(columns=["layer", "head"]).isna().all().all()
