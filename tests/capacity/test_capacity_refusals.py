"""The newer surfaces keep the bad-input promise (issue 27): a clear error naming the fix, or a
documented value; never a silent wrong answer or a traceback from deep inside.

One test per class: zero values in both engine backends, ``sparsify_pattern``'s ``n`` and
weights, token ids and meta tokens at every ablation entry point, a reused sweep of other
tokens, result-file checksums and odd save paths, and the CLI options refused before the load.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from shared_checks import as_format_2
from test_capacity import tiny_lm

from tl_geometry.ablation import ablate_heads, head_sensitivity
from tl_geometry.analyze import analyze_heads
from tl_geometry.capacity import (
    capacity_correlation,
    capacity_sweep,
    retrieval_capacity,
    sparsify_pattern,
    top_n_attention,
)
from tl_geometry.cli import main as cli
from tl_geometry.result import HeadAnalysis, ResultFileError
from tl_geometry.result import io as _result_io

# --- engine: zero values, zero rows -------------------------------------------------------------


def _pattern(seed: int = 0, batch: int = 2, heads: int = 4, pos: int = 10) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(batch, heads, pos, pos, generator=g, dtype=torch.float64).tril()
    return p / p.sum(-1, keepdim=True)


def _zero_cases() -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    p = _pattern()
    v = torch.randn(2, 10, 2, 8, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    one_kv_zero = v.clone()
    one_kv_zero[:, :, 1] = 0
    last_row_zero = p.clone()
    last_row_zero[:, :, -1] = 0
    only_sink = torch.zeros_like(v)
    only_sink[:, 0] = v[:, 0]
    return {
        "all values zero": (p, torch.zeros_like(v)),
        "only the sink has a value": (p, only_sink),
        "one KV head zero": (p, one_kv_zero),
        "last query row zero": (last_row_zero, v),
        "pattern all zero": (torch.zeros_like(p), v),
    }


@pytest.mark.parametrize("case", list(_zero_cases()))
def test_zero_values_and_zero_rows_give_the_same_numbers_in_both_backends(case):
    """Pruned or dead heads are real: the numba kernels used to raise ZeroDivisionError here.
    Both backends give the same numbers: κ = +inf when only the sink has a value (documented),
    κ and the sink share NaN (0/0) where no value has a norm."""
    pattern, v = _zero_cases()[case]
    cache = {"blocks.0.attn.hook_pattern": pattern, "blocks.0.attn.hook_v": v}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a zero row is warning-only
        compiled = analyze_heads(cache, n_values=(1, 2, 4), backend="numba")
        twin = analyze_heads(cache, n_values=(1, 2, 4), backend="torch")
    for key in ("scores", "sink", "group_counts", "vote_counts"):
        a, b = getattr(compiled, key), getattr(twin, key)
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-12, equal_nan=True, msg=key)
    fields = list(_result_io.names()["sink_field"])
    kappa, share = compiled.sink[fields.index("norm_ratio")], compiled.sink[fields.index("share")]
    if case == "all values zero":  # no scale without a value norm
        assert kappa.isnan().all() and share.isnan().all()
    elif case == "only the sink has a value":
        assert torch.isposinf(kappa).all() and (share == 1).all()
    else:
        assert torch.isfinite(kappa).any()


# --- sparsify_pattern: n and weights --------------------------------------------------------------


@pytest.mark.parametrize("n", [0, -1, 1.5, 2.0, True, False, "2", None, 2**70,
                               torch.tensor(2.5), torch.tensor([1, 2]), torch.tensor(0),
                               torch.tensor(True)])
def test_sparsify_pattern_refuses_every_n_that_is_not_a_count(n):
    pattern = _pattern(pos=6).float()
    before = pattern.clone()
    with pytest.raises(ValueError, match=r"^n ") as info:
        sparsify_pattern(pattern, n)
    assert "Overflow" not in str(info.value)
    assert torch.equal(pattern, before)


def test_sparsify_pattern_keeps_int_tensors_that_broadcast():
    pattern = _pattern(pos=6).float()
    assert torch.equal(sparsify_pattern(pattern, torch.tensor(2)), sparsify_pattern(pattern, 2))
    per_sequence = torch.tensor([1, 3])[:, None, None]  # one N per sequence
    out = sparsify_pattern(pattern, per_sequence)
    assert torch.equal(out[0], sparsify_pattern(pattern[0], 1))
    assert torch.equal(out[1], sparsify_pattern(pattern[1], 3))


def test_top_n_attention_names_the_range_and_refuses_repeated_layers():
    model = tiny_lm(2)
    with pytest.raises(ValueError, match=r"at most 2\*\*63 - 1"):
        top_n_attention(model, 2**70)
    with pytest.raises(ValueError, match="layers has duplicates"):
        top_n_attention(model, 2, layers=[0, 0])


@pytest.mark.parametrize(("change", "match"), [
    (lambda p: p.index_put_((torch.tensor(0),), torch.tensor(-0.1)), "negative"),
    (lambda p: p.fill_(math.nan), "NaN"),
    (lambda p: p.to("meta"), "meta"),
    (lambda p: p.long(), "float tensor"),
])
def test_sparsify_pattern_refuses_weights_that_are_not_attention(change, match):
    pattern = change(_pattern(pos=5).float().clone())
    with pytest.raises(ValueError, match=match):
        sparsify_pattern(pattern, 2)


# --- tokens at every entry point ------------------------------------------------------------------


def _entry_points(model):
    good = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    return {
        "retrieval_capacity": lambda t: retrieval_capacity(model, t, (2,)),
        "head_sensitivity": lambda t: head_sensitivity(model, t, progress=False),
        "capacity_sweep": lambda t: capacity_sweep(model, t, (2,), heads=[(0, 0)]),
        "ablate_heads mean": lambda t: ablate_heads(model, [(0, 0)], "mean", reference_tokens=t),
    }, good


@pytest.mark.parametrize("bad", ["too large", "negative", "meta"])
def test_token_ids_outside_the_vocabulary_or_meta_are_refused_everywhere(bad):
    model = tiny_lm(2)
    entries, good = _entry_points(model)
    tokens = {"too large": good + 40, "negative": good - 41, "meta": good.to("meta")}[bad]
    for name, call in entries.items():
        with pytest.raises(ValueError, match=r"outside the model's vocabulary|meta tensor") as info:
            call(tokens)
        assert "tokens" in str(info.value), name


def test_progress_must_be_a_bool_or_none():
    model = tiny_lm(2)
    tokens = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(0))
    for call in (lambda: retrieval_capacity(model, tokens, (2,), progress="yes"),
                 lambda: capacity_sweep(model, tokens, (2,), progress=1),
                 lambda: head_sensitivity(model, tokens, progress="no")):
        with pytest.raises(ValueError, match="progress must be True, False or None"):
            call()


# --- capacity_correlation: a reused sweep --------------------------------------------------------


def test_a_sweep_of_other_tokens_is_refused_and_a_partial_sweep_says_why_rho_is_nan():
    model = tiny_lm(2)
    tokens = torch.randint(0, 40, (2, 10), generator=torch.Generator().manual_seed(0))
    sweep = capacity_sweep(model, tokens, (2,), heads=[(0, 0), (1, 1)])
    with pytest.raises(ValueError, match=r"shape \[2, 10\], these are \[1, 10\]"):
        capacity_correlation(model, tokens[:1], 2, sweep=sweep)
    other = tokens.flip(0)
    with pytest.raises(ValueError, match="other tokens"):
        capacity_correlation(model, other, 2, sweep=sweep)
    with pytest.warns(UserWarning, match="only 2 head.s. have both"):
        corr = capacity_correlation(model, tokens, 2, sweep=sweep)
    assert all(math.isnan(r) for r in corr.rho.values())
    assert set(corr.notes) == set(corr.rho) and "Sweep more heads" in corr.notes["f_score"]


# --- result files ---------------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path):
    from result_fakes import fake

    return fake(), fake().save(tmp_path / "r.pt")


def test_any_changed_byte_in_the_payload_is_refused(saved, tmp_path):
    _, path = saved
    payload = torch.load(path, weights_only=True)
    flipped = payload["scores"].clone()
    flipped.view(torch.uint8).view(-1)[5] ^= 1  # one bit inside a tensor
    for change in ({"scores": flipped}, {"layers": [0, 5]}, {"metadata": "{\"model_name\": \"edited\"}"}):
        torch.save({**payload, **change}, tmp_path / "edited.pt")
        with pytest.raises(ResultFileError, match="does not match its checksum"):
            HeadAnalysis.load(tmp_path / "edited.pt")
    del payload["checksum"]
    torch.save(payload, tmp_path / "stripped.pt")
    with pytest.raises(ResultFileError, match="has no checksum"):
        HeadAnalysis.load(tmp_path / "stripped.pt")


def test_format_2_files_without_a_checksum_still_load(saved, tmp_path):
    r, path = saved
    payload = torch.load(path, weights_only=True)
    as_format_2(payload)
    torch.save(payload, tmp_path / "v2.pt")
    loaded = HeadAnalysis.load(tmp_path / "v2.pt")
    held = [_result_io.names()["metric"].index(m) for m in payload["names"]["metric"]]
    assert torch.equal(loaded.scores[:, held].nan_to_num(), r.scores[:, held].nan_to_num())
    assert loaded.tail_mass.isnan().all() and loaded.sequence_votes is None  # format 2 lacks them


def test_a_meta_tensor_in_a_payload_is_a_result_file_error(saved, tmp_path):
    _, path = saved
    payload = torch.load(path, weights_only=True)
    payload["sink"] = payload["sink"].to("meta")
    torch.save(payload, tmp_path / "meta.pt")
    with pytest.raises(ResultFileError, match="sink is a meta tensor"):
        HeadAnalysis.load(tmp_path / "meta.pt")


def test_save_to_a_folder_or_under_a_file_names_the_path_and_the_fix(saved, tmp_path):
    r, path = saved
    with pytest.raises(ValueError, match=rf"{tmp_path}: it is a folder\. Give a file path"):
        r.save(tmp_path)
    with pytest.raises(ValueError, match=rf"{path} is a file, not a folder"):
        r.save(path / "x.pt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.pt"]  # nothing left behind


# --- CLI: refused before the model load -----------------------------------------------------------


@pytest.mark.parametrize(("argv", "phrase"), [
    ("capacity --tolerance inf", "finite relative loss increase"),
    ("capacity --tolerance nan", "finite relative loss increase"),
    ("capacity --n-values 99999999999999999999", "at most 2**63 - 1"),
    ("analyze --n-values 99999999999999999999", "at most 2**63 - 1"),
    ("capacity --n-values 200,300 --seq-len 8", "every N is ≥ --seq-len 8"),
    ("capacity --seq-len 8 --n-values 2 --head-n 8", "--head-n 8 is ≥ --seq-len 8"),
    ("prune --retention 0.5,0.5", "lists a fraction twice"),
])
def test_cli_options_are_refused_in_one_line_before_the_load(argv, phrase, monkeypatch, capsys):
    import tl_geometry.inputs.models as models

    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(models, "load_model", no_load)
    with pytest.raises(SystemExit) as info:
        cli.main(argv.split())
    err = capsys.readouterr().err.strip()
    assert info.value.code == 2 and len(err.splitlines()) == 1, err
    assert phrase in err and "Traceback" not in err


def test_checksum_covers_every_entry():
    base = {"format": "x", "layers": [0], "t": torch.arange(4.0)}
    digest = _result_io.checksum(base)
    assert _result_io.checksum({**base, "checksum": "anything"}) == digest
    assert _result_io.checksum({**base, "t": torch.arange(4.0).reshape(2, 2)}) != digest
    assert _result_io.checksum({**base, "t": torch.arange(4.0).double()}) != digest
    assert _result_io.checksum({**base, "layers": [1]}) != digest
