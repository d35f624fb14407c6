"""demos/reproduce.py: its helpers, and the quick mode end to end on the session's real models."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest
import torch
from repo_paths import REPO

ROOT = REPO
sys.path.insert(0, str(ROOT / "demos"))

import reproduce  # noqa: E402
from _reproduce import certificates, corpora, document, rules, separability, sink, stats  # noqa: E402
from _reproduce.claims import HELD, NOT_HELD, PARTLY, verdict  # noqa: E402
from _reproduce.intervals import NO_INTERVAL, NO_SINK, NOT_MEASURED, TOO_FEW, UNDECIDED  # noqa: E402
from _reproduce.protocol import FULL, QUICK  # noqa: E402
from _reproduce.study import Step, Study  # noqa: E402

VERDICTS = (HELD, PARTLY, NOT_HELD)


def test_table_formats_markdown_and_rejects_ragged_rows():
    text = document.table(["a", "b"], [["x", "1.5"], ["y|z", "2"]])
    assert text.splitlines() == ["| a | b |", "| :--- | ---: |", "| x | 1.5 |", "| y\\|z | 2 |"]
    with pytest.raises(ValueError, match="cells"):
        document.table(["a", "b"], [["only one"]])
    assert document.fmt(float("nan")) == "–" and document.fmt(0.12345) == "0.123"
    assert document.pct(0.0575) == "5.8 %"


def test_spearman_matches_hand_computed_values():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    assert stats.spearman(x, x**3) == pytest.approx(1.0)
    assert stats.spearman(x, -x) == pytest.approx(-1.0)
    # Ties get average ranks: ranks of y are 1.5, 1.5, 3, 4, 5 → Pearson of the ranks.
    y = torch.tensor([0.0, 0.0, 1.0, 2.0, 3.0])
    expected = stats.pearson(x, torch.tensor([1.5, 1.5, 3.0, 4.0, 5.0]))
    assert stats.spearman(x, y) == pytest.approx(expected)
    # NaN pairs are dropped; fewer than three pairs is undefined.
    assert stats.spearman(torch.tensor([1.0, float("nan"), 3.0, 4.0]),
                          torch.tensor([2.0, 5.0, 6.0, 8.0])) == pytest.approx(1.0)
    assert math.isnan(stats.spearman(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0])))


def test_verdict_rule():
    assert verdict({"a": [True, True], "b": [True, True]}, "a") == HELD
    assert verdict({"a": [True, False], "b": [True, True]}, "a") == PARTLY
    assert verdict({"a": [False, False], "b": [True, True]}, "a") == NOT_HELD


def test_protocol_sizes():
    # SPEC §8 / the issue: ≥ 64 windows of 1024 tokens (the paper's length).
    assert FULL.n_windows >= 64 and FULL.seq_len == 1024 and FULL.random_samples == 16
    assert FULL.n_values == tuple(2**k for k in range(11) if 2**k < FULL.seq_len)
    assert QUICK.n_values[-1] < QUICK.seq_len and {2, 4, 8} <= set(QUICK.n_values)
    # The headline range 2 ≤ N ≤ (t+1)/4 of both: N = 2 … 256 at 1024 keys, 2, 4, 8 at 48.
    assert rules.headline_ns(FULL.n_values, FULL.seq_len) == [2, 4, 8, 16, 32, 64, 128, 256]
    assert rules.headline_ns(QUICK.n_values, QUICK.seq_len) == [2, 4, 8]
    assert rules.headline_ns([1, 2, 4, 8], 31) == [2, 4]  # 8 > 31/4


# --- the verdict rules, on hand-made numbers ------------------------------------------------


def test_agreement_and_its_chance_level():
    a = torch.tensor([2.0, 2.0, 4.0, 4.0, math.nan])
    b = torch.tensor([2.0, 4.0, 4.0, 4.0, 2.0])
    share, chance, count = rules.agreement(a, b)
    assert count == 4 and share == pytest.approx(0.75)
    assert chance == pytest.approx(0.5 * 0.25 + 0.5 * 0.75)
    assert math.isnan(rules.agreement(torch.tensor([math.nan]), torch.tensor([2.0]))[0])


def test_claim1_rule_reads_the_headline_range_and_the_shuffled_null():
    ns = [1, 2, 4, 8, 16]
    run = separability.TopVsRandom(ns, [1, 2, 3], top=[1.0, 0.6, 0.5, 0.4, 0.9],
                                   shuffled=[1.0, 0.58, 0.4, 0.38, 0.9], random=[1.0, 0.2, 0.1, 0.1, 0.1])
    assert run.never_lowers and run.geometric and run.small and run.best == 2
    assert run.above_random and run.gain[2] == pytest.approx(0.4)  # the attention ranking's: no check
    assert run.geometry[2] == pytest.approx(0.1) and run.ranking[2] == pytest.approx(0.3)
    # Dense N (16 here) never enters the rule, whatever it shows.
    assert run.best == 2 and run.max_geometry == pytest.approx(0.1)
    # The shuffled null matching the top set everywhere: the geometry carries nothing.
    flat = separability.TopVsRandom(ns, [1, 2, 3], top=run.top, shuffled=run.top, random=run.random)
    assert flat.above_random and flat.never_lowers and not flat.geometric
    assert flat.lowering == [] and flat.min_geometry == 0.0
    # A negative gap is read too: geometry lowers separability there, never "equal".
    lower = separability.TopVsRandom(ns, [1, 2, 3], top=run.top, shuffled=[1.0, 0.7, 0.52, 0.41, 0.0],
                                     random=run.random)
    assert not lower.geometric and lower.lowering == [2] and lower.min_geometry == pytest.approx(-0.1)
    assert not lower.never_lowers and lower.above_random  # (a) fails; the ranking's gain is unchanged
    # Below random at one headline N (the ranking's figure, no check), or peaking at N = 8: (c) fails.
    worse = separability.TopVsRandom(ns, [1, 2, 3], top=[1.0, 0.3, 0.5, 0.6, 0.0],
                                     shuffled=[0.0] * 5, random=[0.0, 0.35, 0.1, 0.1, 0.0])
    assert not worse.above_random and worse.best == 8 and not worse.small
    assert worse.best_shuffled == 2  # ties → the smaller N
    empty = separability.TopVsRandom(ns, [], top=run.top, shuffled=run.top, random=run.random)
    assert not empty.above_random and not empty.never_lowers and empty.best is None


def test_claim3_rule_is_the_median_over_heads_of_the_paired_figures():
    ratio = torch.tensor([[0.4, 0.8, 1.2], [0.5, 0.3, math.nan]])
    halved = torch.tensor([[0.6, 0.1, 0.0], [0.5, 0.9, math.nan]])
    count = torch.tensor([[10.0, 10.0, 10.0], [10.0, 2.0, 0.0]])
    p = sink.paired(4, ratio, halved, count, min_count=8)  # heads with < 8 instances left out
    assert p.heads == 4 and p.ratio == pytest.approx(0.65) and p.halved == pytest.approx(0.3)
    assert p.lowers and p.halves
    high = sink.paired(2, ratio + 1, halved * 0, count, min_count=8)
    assert not high.lowers and not high.halves
    none = sink.paired(8, ratio, halved, count, min_count=11)
    assert not none.defined and not none.lowers
    # Lowers at every N where a head qualifies (undefined N are skipped, but one must exist).
    assert sink.run_checks([p, none]) == (True, True)
    assert sink.run_checks([p, high]) == (False, True)
    assert sink.run_checks([none]) == (False, False)


def test_claim3_counts_heads_whose_sink_removed_f_is_zero_as_the_largest_ratio():
    """A head whose median paired ratio is +inf (the sink-removed F_N is 0 where the sink's is
    not) is a head where the sink raises F_N: dropping it would pull the median head towards
    "the sink lowers F_N". It counts, as the largest ratio, in the point figure and over windows."""
    ratio = torch.tensor([[0.4, 0.8, math.inf], [math.inf, math.inf, math.nan]])
    halved = torch.zeros(2, 3)
    count = torch.full((2, 3), 10.0)
    p = sink.paired(4, ratio, halved, count, min_count=8)
    assert p.heads == 5 and p.ratio == math.inf and not p.lowers
    assert p.ratio_q[0] == pytest.approx(0.8) and p.ratio_q[1] == math.inf
    finite = sink.paired(4, torch.tensor([[0.4, 0.8, 1.2]]), halved[:1], count[:1], min_count=8)
    assert finite.ratio == pytest.approx(0.8) and finite.ratio_q == pytest.approx((0.6, 1.0))
    # Per window: 8 windows, three heads; the third has F_N = 0 without the sink in every window.
    with_sink = torch.tensor([0.3, 0.4, 0.5]).repeat(8, 1)[:, None, :, None].double()
    removed = torch.tensor([0.6, 0.5, 0.0]).repeat(8, 1)[:, None, :, None].double()
    ratios = torch.where(removed > 0, with_sink / removed, math.inf)
    med, _, heads, quartiles = sink._over_heads(ratios, min_count=8)
    assert int(heads[0]) == 3 and float(med[0]) == pytest.approx(0.8)  # 0.5, 0.8, +inf
    assert float(quartiles[0, 1]) == math.inf


def test_claim4_rule_on_a_bound_that_tracks_and_one_that_does_not():
    ns, hl = [1, 2, 4, 8], [1, 2, 3]
    measured = torch.tensor([[[1.0, 0.9, 0.5, 0.2], [1.0, 0.4, 0.8, 0.1]],
                             [[1.0, 0.7, 0.6, 0.3], [1.0, 0.2, 0.3, 0.5]]])
    good = measured * 0.8
    best = torch.tensor([[2.0, 4.0], [2.0, 8.0]])  # the measured best N of each head
    fit = certificates.fit(good, measured, ns, hl, best, best)
    assert fit.rhos == pytest.approx({2: 1.0, 4: 1.0, 8: 1.0}) and fit.tracks  # within each N
    assert fit.ratio_2 == pytest.approx(0.8) and fit.agree == 1.0 and fit.heads == 4
    assert fit.chance == pytest.approx(0.5 * 0.5 + 0.25 * 0.25 + 0.25 * 0.25)
    # Four heads: a perfect agreement still happens in 1/6 of the shuffles (p ≈ 0.17): not shown
    # to exceed chance.
    assert not fit.predicts and fit.best.p_value > 0.05
    empty = torch.zeros_like(measured)  # the regime envelope on real heads: sound and empty
    fit0 = certificates.fit(empty, measured, ns, hl, torch.full_like(best, math.nan), best)
    assert math.isnan(fit0.rho_min) and not fit0.tracks and fit0.heads == 0 and not fit0.predicts
    assert certificates.count_violations(good, measured) == (0, 16)
    above = good.clone()
    above[0, 0, 1] = 0.95
    assert certificates.count_violations(above, measured) == (1, 16)


def test_claim4_tracks_is_read_within_each_n_and_predicts_against_chance():
    """A bound that falls with N like every measured curve but orders the heads at random looks
    good pooled over (head, N); within each N it does not track. A bound that always names the
    most common best N agrees often, and exactly as often as chance."""
    g = torch.Generator().manual_seed(0)
    ns, hl = [1, 2, 4, 8], [1, 2, 3]
    level = torch.tensor([1.0, 0.9, 0.6, 0.3])
    measured = level + 0.05 * torch.rand(5, 8, 4, generator=g)
    shuffled_heads = level + 0.05 * torch.rand(5, 8, 4, generator=g)
    best = torch.where(torch.rand(5, 8, generator=g) < 0.8, 2.0, 4.0)
    fit = certificates.fit(shuffled_heads, measured, ns, hl, torch.full_like(best, 2.0), best)
    assert stats.spearman(shuffled_heads[..., hl], measured[..., hl]) > 0.8  # the pooled ρ would pass
    assert fit.rho_min < 0.5 and not fit.tracks
    assert fit.agree == pytest.approx(float((best == 2).double().mean()))
    assert fit.chance == pytest.approx(fit.agree) and not fit.predicts  # at chance: predicts nothing
    many = certificates.fit(measured * 0.9, measured, ns, hl, best, best)
    assert many.tracks and many.predicts and many.best.p_value < 0.01 and many.best.excess > 0


def test_run_time_line_is_honest_about_reused_steps():
    study = Study(QUICK, {}, {})
    study.steps = {"load m": Step(3.0, 2, "2026-01-01 10:00"),
                   "analyze m c": Step(120.0, 2, "2026-01-01 10:00")}
    assert reproduce.run_time(study, 130.0, 2).startswith("2.2 min on 2 CPU threads")
    study.steps["analyze m c"] = Step(120.0, 2, "2025-12-31 09:00", reused=True)
    study.steps["ablation m"] = Step(60.0, 2, "2026-01-01 10:00")
    line = reproduce.run_time(study, 70.0, 4)
    assert "3.0 min for the analyses" in line and "1 of 2 steps were loaded" in line
    assert "computed 2025-12-31 09:00 UTC on 2 CPU threads" in line
    assert "re-rendered from them in 1.2 min, computing ablation m anew on 4 threads" in line
    whole = Step(500.0, 2, "2025-12-31 09:00", reused=True)
    assert ("that run took 8.3 min in all on 2 CPU threads, model loading included"
            in reproduce.run_time(study, 70.0, 4, whole))
    # Steps saved after the recorded run (a model added later) are not "that run"'s.
    study.steps["analyze m2 c"] = Step(90.0, 2, "2026-01-02 08:00", reused=True)
    line = reproduce.run_time(study, 70.0, 4, whole)
    assert "that run took" not in line and ("the run recorded on 2025-12-31 09:00 UTC took 8.3 min in all on "
                                            "2 CPU threads, model loading included, and 1 of the steps were "
                                            "computed by later runs") in line


def test_stdlib_corpus_is_deterministic_and_long_enough():
    a, b = corpora.python_stdlib(), corpora.python_stdlib()
    assert a.text == b.text
    assert a.text.startswith("# ---- argparse ----\n")
    assert len(a.text) > 64 * 1024 * 3  # ≥ 3 characters per token needed for 64 × 1024
    assert all(f"# ---- {name} ----" in a.text for name in corpora.STDLIB_MODULES)


def test_missing_wikitext_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="--wikitext"):
        corpora.wikitext(tmp_path / "nope.txt")


@pytest.mark.parametrize("argv", [["--seq-len", "16"], ["--n-windows", "0"], ["--models", "gpt2"],
                                  ["--ablation-windows", "1"]])
def test_cli_rejects_bad_sizes(argv, capsys):
    with pytest.raises(SystemExit):
        reproduce.main(argv)
    assert "error" in capsys.readouterr().err


def test_page_names_the_command_that_computes_it_again():
    assert reproduce._command(["--reuse", "--n-windows", "16", "--out", "docs/sizes", "--no-progress"]) \
        == "python demos/reproduce.py --n-windows 16 --out docs/sizes"
    assert reproduce._command([]) == "python demos/reproduce.py"


@pytest.mark.real_model
def test_quick_mode_writes_a_complete_page(smollm2, gemma3, tmp_path):
    committed = ROOT / "docs" / "results.md"
    before = committed.read_bytes() if committed.exists() else None
    models = {"smollm2-135m": smollm2.model, "gemma3-270m": gemma3.model}
    lines: list[str] = []
    path = reproduce.reproduce(models, QUICK, tmp_path, progress=False, log=lines.append)

    assert path == tmp_path / "results.md"
    text = path.read_text()
    assert "quick mode" in text and "3 windows × 48 tokens" in text
    for number in range(1, 8):  # claims 1–5, 6 (ablation) and 7 (retrieval capacity)
        match = re.search(rf"## Claim {number}: .*?\*\*Verdict: ([a-z ()]+)\.\*\*", text, re.S)
        # SPEC §8: 3 windows are too few for an interval, so a claim may read "too few"; a weak
        # sink (SPEC §1) makes the sink claims "no sink".
        assert match and (match.group(1) in (*VERDICTS, TOO_FEW, NO_SINK)
                          or match.group(1).startswith(UNDECIDED)), \
            f"claim {number} has no verdict"
    # Every model × corpus appears in the tables (Gemma-3's global and local layers as two runs,
    # SPEC §8 (i)), and every figure the page links exists.
    for run in ("smollm2-135m", "gemma3-270m · global", "gemma3-270m · local"):
        for corpus in ("python-stdlib",):
            assert f"| {run} | {corpus} |" in text
    figures = re.findall(r"!\[[^\]]*\]\((results/[^)]+\.png)\)", text)
    assert len(figures) == 8
    for name in figures:
        png = tmp_path / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The shell and inversion certificates are theorems, and at 48 tokens the regime bound reads
    # every pair of cosines (a certificate too): never violated.
    respected = re.findall(r"\| (\d+)/(\d+) \|", text)
    assert respected and all(a == b for a, b in respected)
    assert "## How the claims move with model size" in text and "| 135M (smollm2-135m) |" in text
    assert (committed.read_bytes() if committed.exists() else None) == before  # tests never write docs/
    assert any(line.startswith("wrote") for line in lines)
    # Each model × corpus ran one forward for its analysis and the three decomposition nulls.
    together = [line for line in lines if "(values, norms, directions, unselected): 3 windows" in line]
    assert len(together) == len(models) * 2


def test_reproduce_modules_import_each_other_without_a_cycle():
    """Every import in demos/reproduce.py and demos/_reproduce, also those inside functions:
    the graph of the package's own modules has no cycle."""
    import ast

    demos = REPO / "demos"
    files = {"reproduce": demos / "reproduce.py"}
    files |= {f"_reproduce.{p.stem}": p for p in (demos / "_reproduce").glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = "_reproduce" if node.level else (node.module or "")
                module = f"{base}.{node.module}" if node.level and node.module else base
                targets |= {module} | {f"{module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
        graph[name] = targets & set(files)
    assert graph["_reproduce.study"] >= {"_reproduce.ablation", "_reproduce.protocol"}  # it sees them

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node):], node]
        return next((c for nxt in sorted(graph[node]) if (c := cycle_from(nxt, [*path, node]))), None)

    assert [c for name in graph if (c := cycle_from(name, []))] == []


# --- the claims end to end, on hand-built analyses ----------------------------------------------


def _fake_study(seed: int = 0) -> Study:
    """Four runs of hand-built analyses with values in [0, 1], bounds below the measured values,
    the paired sink figures filled in, at 48 keys (headline N = 2, 4, 8) and 12 windows."""
    from dataclasses import replace

    from result_fakes import fake

    from tl_geometry.result import METRIC_NAMES, PAIRED_FIELDS

    g = torch.Generator().manual_seed(seed)
    analyses = {}
    for model in ("m1", "m2"):
        for corpus in ("c1", "c2"):
            r = fake(layers=(0, 1, 2), n_heads=4, n_values=(1, 2, 4, 8, 16), bounds=True,
                     metadata={"n_positions": 48, "n_sequences": 12})
            r.scores = torch.rand(r.scores.shape, generator=g, dtype=torch.float64)
            prf = [METRIC_NAMES.index(m) for m in ("precision", "recall", "f_score")]
            r.bounds = torch.rand(r.bounds.shape, generator=g, dtype=torch.float64)
            r.bounds[:, :3] *= r.scores[0, prf]  # every bound on P, R, F below the measured value
            r.sink = torch.rand(r.sink.shape, generator=g, dtype=torch.float64) - 0.5
            shape = (len(PAIRED_FIELDS), *r.scores.shape[2:])
            r.paired = torch.rand(shape, generator=g, dtype=torch.float64)
            r.paired[PAIRED_FIELDS.index("count")] = torch.randint(0, 13, shape[1:], generator=g).double()
            analyses[model, corpus] = r
    texts = {c: corpora.Corpus(c, "text", "a fake corpus") for c in ("c1", "c2")}
    return Study(replace(QUICK, n_windows=12), texts, analyses)


def _as_saved_today(r):
    """``r`` as today's study saves an analysis: with its per-window arrays, the sink check and
    how its windows start (a saved analysis without them is recomputed)."""
    from tl_geometry.result.schema import WINDOW_GROUPS

    n_seq = r.sequence_votes.shape[0] if r.sequence_votes is not None else int(r.metadata["n_sequences"])
    r.window_scores = torch.zeros(n_seq, len(WINDOW_GROUPS), *r.scores.shape[1:], dtype=torch.float64)
    r.window_sink = torch.zeros(n_seq, *r.sink.shape, dtype=torch.float64)
    if r.bounds is not None:
        r.window_bounds = torch.zeros(n_seq, *r.bounds.shape, dtype=torch.float64)
    r.metadata.update(sink={"rule": "given", "positions": [0]}, reproduce_window_start="text")
    return r


def test_every_claim_renders_on_fake_analyses(tmp_path):
    from _reproduce import ablation, capacity
    from _reproduce.claims import CLAIMS

    study = _fake_study()
    claims = [claim(study, tmp_path) for claim in CLAIMS]
    claims += [ablation.claim6(study, tmp_path), capacity.claim7(study, tmp_path)]
    # SPEC §8: a verdict may also be undecided on its intervals, have too few windows (the
    # fakes hold 3 windows of votes), or no interval (the fakes hold no per-window values).
    readable = [c.verdict in (*VERDICTS, TOO_FEW, NO_INTERVAL, NOT_MEASURED) or c.verdict.startswith(UNDECIDED)
                for c in claims]
    assert readable == [True] * 7
    page = document.page(["# fake"], claims, "results")
    assert "(ours)" in page and "headline" in page
    assert len(list(tmp_path.glob("*.png"))) == 7  # claims 1–5 (claim 4: three figures)


def test_size_section_decides_every_claim_per_model(tmp_path):
    """Each claim is decided again on one model's runs alone (the pooled page is unchanged) and
    the section reads its direction across sizes by the rule it prints."""
    from _reproduce import ablation, capacity, sizes
    from _reproduce.claims import CLAIMS

    study = _fake_study()
    every = (*CLAIMS, ablation.claim6, capacity.claim7)
    pooled = [claim(study, tmp_path) for claim in every]
    by_model = sizes.per_model(study, every)
    assert list(by_model) == ["m1", "m2"] and all(len(c) == 7 for c in by_model.values())
    one = sizes.one_model(study, "m2")
    assert set(one.analyses) == {("m2", "c1"), ("m2", "c2")} and study.models == ["m1", "m2"]
    # Claim 1 on m1 alone is claim 1 on a study holding m1's runs only.
    alone = Study(study.config, study.corpora, {k: v for k, v in study.analyses.items() if k[0] == "m1"})
    assert by_model["m1"][0].because == CLAIMS[0](alone, tmp_path).because
    section = "\n".join(sizes.section(pooled, by_model))
    assert section.startswith("## How the claims move with model size")
    assert section.count("- **Claim ") == 7 and "| m1 (m1) | m2 (m2) |" in section
    page = document.page(["# fake"], pooled, "results", sizes.section(pooled, by_model))
    assert page.index("## Where our models disagree") < page.index("## How the claims move") \
        < page.index("## Claim 1:")
    assert [sizes.direction(v) for v in ([HELD, HELD, HELD], [HELD, PARTLY, NOT_HELD],
                                         [NOT_HELD, PARTLY, PARTLY], [HELD, NOT_HELD, HELD])] == [
        "keeps the same verdict at every size", "weakens as size grows", "strengthens as size grows",
        "moves without a trend"]


def _windows(r, n: int = 12):
    """``r`` with per-window arrays in which every window holds the analysis's own means (their
    mean over windows is ``r.scores``; every interval is a point)."""
    from tl_geometry.result.schema import WINDOW_GROUPS

    groups = r.scores[:len(WINDOW_GROUPS)].float()
    r.window_scores = groups[None].expand(n, *groups.shape).clone()
    r.window_sink = r.sink.float()[None].expand(n, *r.sink.shape).clone()
    return r


def _bound_windows(r, n: int = 12):
    """``r`` with per-window bounds in which every window holds the analysis's own mean bounds."""
    r.window_bounds = r.bounds.float()[None].expand(n, *r.bounds.shape).clone()
    return r


def test_claims_read_the_new_measures(tmp_path, monkeypatch):
    """Claim 1 follows the shuffled group, claim 3 the paired figures, claim 4 the §6b envelope."""
    from _reproduce.certificates import claim4
    from _reproduce.separability import claim1
    from _reproduce.sink import claim3

    from tl_geometry.result import BOUND_KINDS, GROUPS, METRIC_NAMES, PAIRED_FIELDS

    _quick_intervals(monkeypatch)

    study = _fake_study()
    cc, f = METRIC_NAMES.index("f_score_cc"), METRIC_NAMES.index("f_score")
    top, shuffled, rnd = (GROUPS.index(g) for g in ("top", "shuffled", "random"))
    for r in study.analyses.values():
        r.scores[top, cc] = 0.9 - 0.1 * torch.arange(5.0)  # peaks at N = 2 (N = 1 is skipped)
        r.scores[shuffled, cc] = 0.5
        r.scores[rnd, cc] = 0.1
    assert claim1(study, tmp_path).verdict == NO_INTERVAL  # no per-window values: not decided
    for r in study.analyses.values():
        _windows(r)
    assert claim1(study, tmp_path).verdict == HELD
    for r in study.analyses.values():
        r.scores[shuffled, cc] = r.scores[top, cc]  # the geometry carries nothing
        _windows(r)
    nil = claim1(study, tmp_path)  # F∗(top) > F∗(random) still (the attention ranking): no verdict
    assert nil.verdict == NOT_HELD and "the value-shuffle null matches the top-N set" in " ".join(nil.disagreements)
    for r in study.analyses.values():
        r.scores[shuffled, cc] = r.scores[top, cc] + 0.1  # the geometry lowers separability
        _windows(r)
    lowered = claim1(study, tmp_path)
    notes = " ".join(lowered.disagreements)
    assert lowered.verdict == NOT_HELD and "geometry lowers separability at N = 2" in notes
    assert "matches the top-N set" not in notes and "(and lowers it by ≥ 0.05 at some headline N on 4/4)" \
        in lowered.because

    sink_in, removed = GROUPS.index("sink_in"), GROUPS.index("sink_removed")
    for r in study.analyses.values():
        r.paired[PAIRED_FIELDS.index("ratio")] = 0.4
        r.paired[PAIRED_FIELDS.index("halved")] = 0.6
        r.paired[PAIRED_FIELDS.index("count")] = 12.0
        # Claim 3 reads each window's paired ratio, F(sink in S_N) / F(sink removed), on intervals.
        r.window_scores[:, removed, f] = 0.8
        r.window_scores[:, sink_in, f] = 0.8 * 0.4
    assert claim3(study, tmp_path).verdict == HELD
    for r in study.analyses.values():
        r.paired[PAIRED_FIELDS.index("ratio")] = 1.0  # within heads the sink changes nothing
        r.window_scores[:, sink_in, f] = r.window_scores[:, removed, f]
    assert claim3(study, tmp_path).verdict == NOT_HELD

    for r in study.analyses.values():
        r.scores[top, f] = torch.rand(r.scores[top, f].shape, dtype=torch.float64) * 0.5 + 0.5
        r.bounds[:, 2] = r.scores[top, f] * 0.5  # every F bound below the new measured F
        for kind in ("predicted", "shell", "shell_n"):
            r.bounds[BOUND_KINDS.index(kind), 2] = r.scores[top, f] * 0.9  # tracks, same best N
        _bound_windows(_windows(r))
    sound = claim4(study, tmp_path)
    assert ("the paper's regime envelope (SPEC §6b) tracks the measured F_N across heads (ρ ≥ 0.5 within "
            "every headline N) on 4/4 runs") in sound.because
    assert "gives the measured best N more often than chance on 4/4 runs" in sound.because
    assert "the inversion certificate (§6a) never violated on 4/4 runs" in sound.because
    assert sound.verdict != NOT_HELD
    r = study.analyses["m1", "c1"]
    r.bounds[BOUND_KINDS.index("inversion"), 2, 0, 0, 1] = r.scores[top, f, 0, 0, 1] + 0.01
    assert claim4(study, tmp_path).verdict == NOT_HELD  # a violated inversion certificate is a bug
    r.bounds[BOUND_KINDS.index("inversion"), 2, 0, 0, 1] = 0.0
    # Our shell certificate decides nothing (SPEC §8 (ii)): violated, it is listed as a bug.
    r.bounds[BOUND_KINDS.index("shell"), 2, 0, 0, 1] = r.scores[top, f, 0, 0, 1] + 0.01
    ours = claim4(study, tmp_path)
    assert ours.verdict == sound.verdict and "below our shell certificate" in " ".join(ours.disagreements)
    r.bounds[BOUND_KINDS.index("shell"), 2, 0, 0, 1] = 0.0
    r.bounds[BOUND_KINDS.index("certified"), 2, 0, 0, 1] = r.scores[top, f, 0, 0, 1] + 0.01
    sampled = claim4(study, tmp_path)  # the regime bound is a diagnostic (sampled on long windows)
    assert sampled.verdict == sound.verdict and "certified regime bound" in " ".join(sampled.disagreements)


def _quick_intervals(monkeypatch, resamples: int = 100):
    """Claims 1 and 4 with fewer bootstrap resamples and no figures: the tests below read the
    verdict rules, on windows that all hold the same means (every interval is a point)."""
    import functools

    from _reproduce import intervals, plots

    for module in (certificates, separability):
        monkeypatch.setattr(module, "bootstraps", functools.partial(intervals.bootstraps, resamples=resamples))
    monkeypatch.setattr(plots, "grid", lambda *a, **k: None)


def _claim4_study(envelope, shell):
    """The fake study with a measured F_N that differs across heads and N, every §6b envelope and
    shell bound (K = 0 and K = N) set from it by ``envelope(f)`` and ``shell(f)``, c_sink equal to
    R_2 (so the sink part of claim 4 holds), and per-window arrays in which every window holds the
    analysis's means."""
    from tl_geometry.result import BOUND_KINDS, GROUPS, METRIC_NAMES
    from tl_geometry.result.schema import names

    study = _fake_study()
    top, f, recall = GROUPS.index("top"), METRIC_NAMES.index("f_score"), METRIC_NAMES.index("recall")
    g = torch.Generator().manual_seed(3)
    for r in study.analyses.values():
        r.scores[top, f] = torch.rand(r.scores[top, f].shape, generator=g, dtype=torch.float64) * 0.5 + 0.5
        r.bounds[:, 2] = r.scores[top, f] * 0.5  # every F bound below the measured F
        r.bounds[BOUND_KINDS.index("predicted"), 2] = envelope(r.scores[top, f])
        for kind in ("shell", "shell_n"):
            r.bounds[BOUND_KINDS.index(kind), 2] = shell(r.scores[top, f])
        r.sink[names()["sink_field"].index("cosine")] = r.scores[top, recall, ..., 1]  # R_2
        _bound_windows(_windows(r))
    return study


def _tracks(f):
    return 0.9 * f  # orders the heads as the measured F_N does, at every N: same best N


def _reversed(f):
    return 0.4 * (1.5 - f)  # orders them the other way round (and stays below F_N)


def test_claim4_is_decided_on_the_paper_envelope_and_the_shell_never_changes_it(tmp_path, monkeypatch):
    """SPEC §8 (ii): claim 4 is about the paper's theory, so the §6b envelope decides it; our
    shell certificate (§6d) is reported beside it and changes no verdict, whether it tracks, is
    reversed, is empty or is violated."""
    from _reproduce.certificates import OURS, claim4

    from tl_geometry.result import BOUND_KINDS

    _quick_intervals(monkeypatch)

    def violated(f):
        out = _tracks(f)
        out[0, 0, 1] = f[0, 0, 1] + 0.01
        return out

    shells = (_tracks, _reversed, torch.zeros_like, violated)
    held = [claim4(_claim4_study(_tracks, s), tmp_path) for s in shells]
    assert [c.verdict for c in held] == [HELD] * 4, [c.because for c in held]
    not_held = [claim4(_claim4_study(_reversed, s), tmp_path) for s in shells]
    assert [c.verdict for c in not_held] == [NOT_HELD] * 4  # however well the shell tracks
    assert "below our shell certificate (a bug; SPEC §6d is ours and decides no verdict)" in " ".join(
        held[3].disagreements)
    # The shell's figures stay on the page, labelled as ours; its outcomes are told apart.
    text = "\n".join(map(str, not_held[0].blocks))
    assert OURS == "ours (SPEC §6d), reported, does not decide the paper's claim"
    assert OURS in text and OURS in not_held[0].because and OURS in not_held[0].rule
    assert "ρ(shell K=0, F_N), ours" in text and "| tracks (ours) | predicts (ours) |" in text
    assert "tracks the measured F_N (K = 0 and K = N) on 4/4 runs" in not_held[0].because
    assert "SPEC §6b) tracks the measured F_N across heads (ρ ≥ 0.5 within every headline N) on 0/4 runs" \
        in not_held[0].because
    # Where the envelope fails the page says so with its numbers: F_2 and ρ at every headline N.
    notes = " ".join(not_held[0].disagreements)
    assert "the paper's regime envelope (SPEC §6b) does not track the measured F_N: mean envelope / " \
           "measured F_2 = " in notes
    assert "Spearman ρ across heads within each headline N: N = 2: -1.000, N = 4: -1.000, N = 8: -1.000 " \
           "(below 0.5 at N = 2, 4, 8); smallest -1.000 [-1.000, -1.000]; 12 heads (12 windows)" in notes
    # An envelope equal at every head orders none of them: it does not track.
    flat = claim4(_claim4_study(lambda f: torch.full_like(f, 0.1), _tracks), tmp_path)
    assert flat.verdict == NOT_HELD and "undefined (the envelope equal at every head)" in " ".join(
        flat.disagreements)
    # A saved analysis that kept no per-window envelope (only the shell's slices) has no interval
    # for it: not decided, never decided on the shell instead.
    study = _claim4_study(_tracks, _tracks)
    for r in study.analyses.values():
        r.window_bounds[:, BOUND_KINDS.index("predicted")] = float("nan")
    unsaved = claim4(study, tmp_path)
    assert unsaved.verdict == NO_INTERVAL
    assert "holds no per-window values of the §6b envelope" in " ".join(unsaved.disagreements)


def test_claim1_is_decided_on_the_geometry_gap_never_on_the_gain_over_random(tmp_path, monkeypatch):
    """SPEC §8 (iii): with y = α·v the top-N set beats random subsets through the attention
    ranking alone, so F∗(top) − F∗(random) is shown, labelled, and decides nothing; the verdict
    moves with F∗(top) − F∗(shuffled) only."""
    from _reproduce.separability import BY_CONSTRUCTION, claim1

    from tl_geometry.result import GROUPS, METRIC_NAMES

    _quick_intervals(monkeypatch)
    cc = METRIC_NAMES.index("f_score_cc")
    top, shuffled, rnd = (GROUPS.index(g) for g in ("top", "shuffled", "random"))

    def claim(gap: float, gain: float, gaps: dict | None = None):
        study = _fake_study()
        for key, r in study.analyses.items():
            r.scores[top, cc] = 0.9 - 0.1 * torch.arange(5.0)  # peaks at N = 2 (N = 1 is skipped)
            r.scores[shuffled, cc] = r.scores[top, cc] - (gaps or {}).get(key, gap)
            r.scores[rnd, cc] = r.scores[top, cc] - gain
            _windows(r)
        return claim1(study, tmp_path)

    base = claim(0.1, 0.6)
    assert base.verdict == HELD, base.because
    for gain in (0.6, 0.02, -0.3):  # the ranking's gain shrinks, even turns negative: no change
        moved = claim(0.1, gain)
        assert moved.verdict == base.verdict
    assert (f"F∗(top) − F∗(random) ({BY_CONSTRUCTION}) is above 0 at every headline N on 0/4 runs and "
            "decides nothing") in claim(0.1, -0.3).because
    assert claim(0.0, 0.6).verdict == NOT_HELD  # no effect at every N: (b), the core, on no run
    assert claim(-0.1, 0.6).verdict == NOT_HELD  # lowers at every N
    # Raising at some N on one run is enough for partly held, whatever the gain over random.
    one = {("m1", "c1"): torch.tensor([0.0, 0.1, 0.0, 0.0, 0.0])}
    assert claim(0.0, 0.6, one).verdict == claim(0.0, -0.3, one).verdict == PARTLY
    # The label, exactly, wherever the page shows the gain over random.
    assert BY_CONSTRUCTION == "attention ranking, holds by construction"
    text = "\n".join(map(str, base.blocks))
    assert f"F∗(top) − F∗(random) [95 %]: {BY_CONSTRUCTION}" in text and BY_CONSTRUCTION in base.rule
    # Every thresholded number prints its interval with its windows and heads.
    assert "| m1 | c1 | 2 | 12 / 12 | 0.800 | 0.700 | 0.100 [0.100, 0.100] | raises |" in text
    assert "| m1 | c1 | 12 / 12 | 0.100 [0.100, 0.100] (N = 2) |" in text


def test_reuse_loads_saved_analyses_with_their_run_time(tmp_path):
    import json
    from dataclasses import asdict

    from _reproduce import saved
    from _reproduce.study import analysis_path, load_run, run_study, save_run

    study = _fake_study()
    options = json.dumps(asdict(study.config), sort_keys=True)
    for (model, corpus), r in study.analyses.items():
        r.metadata.update(reproduce_options=options, reproduce_seconds=12.0, reproduce_threads=2,
                          reproduce_date="2026-01-02 03:04", window=None)
        saved.save(_as_saved_today(r), analysis_path(tmp_path, model, corpus), "values")
    again = run_study({}, list(study.corpora.values()), study.config, models=("m1", "m2"),
                      cache_dir=tmp_path, reuse=True, log=lambda _: None)  # no model is loaded
    assert set(again.analyses) == set(study.analyses) and again.reused
    assert again.steps["analyze m1 c1"] == Step(12.0, 2, "2026-01-02 03:04", reused=True)
    line = reproduce.run_time(again, 1.0, 2)
    assert "0.8 min for the analyses" in line and "4 of 4 steps were loaded" in line
    # The whole run's wall time is kept beside the results, for these options only.
    save_run(tmp_path, study.config, 75.0)
    whole = load_run(tmp_path, study.config)
    assert whole is not None and whole.seconds == 75.0 and whole.reused
    assert load_run(tmp_path, QUICK) is None  # other options (12 windows here, QUICK has 3)


def test_reuse_counts_a_forward_shared_by_the_nulls_once(tmp_path):
    """Analyses computed from one forward record it (``reproduce_together``): reused, the
    forward is one step, named after every analysis it made."""
    from _reproduce import saved
    from _reproduce.study import DECOMPOSITION_NULLS, analysis_path, options_of, run_study

    study = _fake_study()
    kinds = ["values", *DECOMPOSITION_NULLS]
    for (model, corpus), r in study.analyses.items():
        for kind in kinds:
            r.metadata.update(reproduce_options=options_of(study.config), reproduce_seconds=30.0,
                              reproduce_threads=2, reproduce_date="2026-01-02 03:04", window=None,
                              reproduce_together=kinds)
            saved.save(_as_saved_today(r), analysis_path(tmp_path, model, corpus, kind), kind)
    again = run_study({}, list(study.corpora.values()), study.config, models=("m1", "m2"),
                      cache_dir=tmp_path, reuse=True, nulls=DECOMPOSITION_NULLS, log=lambda _: None)
    assert set(again.nulls["m1", "c1"]) == set(DECOMPOSITION_NULLS)
    name = "analyze m1 c1 (+ norms, directions, unselected nulls)"
    assert again.steps[name].seconds == 30.0 and len(again.steps) == len(study.analyses)


def test_dotted_model_names_keep_their_ablation_and_capacity_tables_apart(tmp_path):
    """``qwen2.5-coder-0.5b``'s tables: ``with_suffix`` would cut the name at ``.5b`` and write
    both studies to ``qwen2.5-coder-0.json``; each must load back as it was saved."""
    import pandas as pd
    from _reproduce import ablation, capacity

    abl = {"sensitivity": pd.DataFrame({"layer": [0], "loss_increase": [0.5]}),
           "curve": pd.DataFrame({"ordering": ["taxonomy"], "loss": [3.0]}),
           "base_loss": 3.0, "options": "a", "windows": {"curve": torch.ones(1, 8)}}
    cap = {"curve": pd.DataFrame({"n": [4], "mode": ["renormalize"]}),
           "heads": pd.DataFrame({"layer": [0], "f_score": [0.9]}),
           "rho": {"f_score": -0.1}, "seq_len": 128, "options": "c", "windows": {"dense": torch.zeros(8)}}
    ablation.save(abl, tmp_path / "qwen2.5-coder-0.5b__ablation")
    capacity.save(cap, tmp_path / "qwen2.5-coder-0.5b__capacity")
    got_abl = ablation.load(tmp_path / "qwen2.5-coder-0.5b__ablation")
    got_cap = capacity.load(tmp_path / "qwen2.5-coder-0.5b__capacity")
    assert got_abl is not None and got_cap is not None
    assert got_abl["options"] == "a" and got_abl["curve"].equals(abl["curve"])
    assert got_cap["options"] == "c" and got_cap["rho"] == {"f_score": -0.1}
    assert got_cap["curve"].equals(cap["curve"]) and got_cap["heads"].equals(cap["heads"])
    assert got_abl["windows"]["curve"].equal(torch.ones(1, 8)) and got_cap["windows"]["dense"].equal(torch.zeros(8))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"qwen2.5-coder-0.5b__{s}" for s in ("ablation.curve.csv", "ablation.json",
                                             "ablation.sensitivity.csv", "ablation.windows.pt",
                                             "capacity.curve.csv", "capacity.heads.csv", "capacity.json",
                                             "capacity.windows.pt")]


def _ablation_tables(increase: list[float], spread: list[float] | None, base_loss: float = 3.0,
                    n_windows: int = 8) -> dict:
    """One model's claim-6 tables: a 2 × 2 head sweep and curves where the taxonomy order wins,
    with per-window losses: head ``i`` raises window ``b``'s loss by ``increase[i] ± spread[i]``
    (alternating signs) and each curve row's loss moves by ± 0.01 across windows. ``spread=None``:
    tables saved before the per-window losses were kept."""
    import pandas as pd

    sens = pd.DataFrame({"layer": [0, 0, 1, 1], "head": [0, 1, 0, 1], "loss_increase": increase})
    sens["loss"] = base_loss + sens.loss_increase
    rows = []
    for name, losses in (("taxonomy", [3.0, 3.1, 3.2, 5.0, 6.0]), ("weight_norm", [3.0, 3.5, 3.9, 4.0, 5.0]),
                         ("entropy", [3.0, 3.5, 3.9, 4.0, 5.0]), ("random", [3.0, 3.4, 3.8, 4.5, 5.5])):
        rows += [{"ordering": name, "seed": 0 if name == "random" else None, "retention": r, "loss": x}
                 for r, x in zip((1.0, 0.9, 0.75, 0.5, 0.25), losses)]
    curve = pd.DataFrame(rows)
    signs = torch.tensor([(-1.0) ** b for b in range(n_windows)], dtype=torch.float64)
    windows = None
    if spread is not None:
        x, s = torch.tensor(increase, dtype=torch.float64), torch.tensor(spread, dtype=torch.float64)
        dense = torch.full((n_windows,), base_loss, dtype=torch.float64)
        windows = {"sensitivity": (base_loss + x[:, None] + s[:, None] * signs).reshape(2, 2, n_windows),
                   "base": dense, "weight": torch.full((n_windows,), 15.0),
                   "curve": torch.tensor(curve.loss.values, dtype=torch.float64)[:, None] + 0.01 * signs,
                   "held_out_base": dense, "held_out_weight": torch.full((n_windows,), 15.0)}
    return {"sensitivity": sens, "curve": curve, "base_loss": base_loss, "held_out_base_loss": base_loss,
            "windows": windows}


def test_claim6_reads_every_check_on_its_interval_over_windows(tmp_path):
    from _reproduce.ablation import claim6, head_intervals

    study = _fake_study()
    # Head (0, 1) is large with its whole interval above 0.15 nats: critical; (1, 0) is large
    # but its interval straddles 0.15: undecided; (0, 0) and (1, 1) stay below: not critical.
    tables = _ablation_tables([0.01, 0.5, 0.4, 0.12], [0.005, 0.05, 0.8, 0.001])
    intervals = head_intervals(tables)
    assert len(intervals) == 4 and intervals[1].low > 0.15 and intervals[2].low < 0.15 < intervals[2].high
    assert intervals[1].value == pytest.approx(0.5) and intervals[1].n == 8
    study.ablation = dict.fromkeys(("m1", "m2"), tables)
    claim = claim6(study, tmp_path)
    assert claim.verdict == HELD and "critical single heads for 2/2 models" in claim.because
    page = document.page(["# fake"], [claim], "results")
    row = next(line for line in page.splitlines() if line.startswith("| m1 | 3.000 | 0.150 | L0H1 |"))
    assert "| 1 | 1 | L0H1 (0.50 [" in row  # one critical head, one undecided
    assert "| m1 | taxonomy − random (mean) at r = 0.9 | -0.300 [" in page
    # Every head's interval straddles the threshold: (c) is undecided, and so is the verdict.
    study.ablation = {m: _ablation_tables([0.01, 0.5, 0.4, 0.12], [0.2, 0.8, 0.8, 0.2]) for m in ("m1", "m2")}
    noisy = claim6(study, tmp_path)
    assert noisy.verdict == f"{UNDECIDED} ({PARTLY} or {HELD})", noisy.verdict
    assert "critical single heads for 0/2 models (2 undecided)" in noisy.because
    assert any("no single head is critical" in note for note in noisy.disagreements)
    # Fewer than 8 windows: too few for an interval, no verdict.
    study.ablation = {m: _ablation_tables([0.01, 0.5, 0.4, 0.12], [0.005, 0.05, 0.8, 0.001], n_windows=4)
                      for m in ("m1", "m2")}
    assert claim6(study, tmp_path).verdict == TOO_FEW
    # Tables saved before the per-window losses were kept: no interval, no verdict.
    study.ablation = {m: _ablation_tables([0.01, 0.5, 0.4, 0.12], None) for m in ("m1", "m2")}
    old = claim6(study, tmp_path)
    assert old.verdict == NO_INTERVAL and any("keep no per-window losses" in n for n in old.disagreements)


def _capacity_tables(rho_sign: float, n_windows: int = 8, seq_len: int = 32) -> dict:
    """One model's claim-7 tables: relative increases 40 %, 10 %, 3 %, 1 % at N = 1, 2, 4, 8 (± 0.2
    % across windows), and 12 heads whose F_4 orders their loss increase (``rho_sign`` −1: the
    most separable lose least)."""
    import pandas as pd

    ns = [1, 2, 4, 8, 16]
    rel = torch.tensor([0.4, 0.1, 0.03, 0.01, 0.0], dtype=torch.float64)
    signs = torch.tensor([(-1.0) ** b for b in range(n_windows)], dtype=torch.float64)
    dense = torch.full((n_windows,), 3.0, dtype=torch.float64)
    loss = 3.0 * (1 + rel[:, None] + 0.002 * signs)
    f = torch.linspace(0.1, 0.9, 12, dtype=torch.float64).reshape(3, 4)
    increase = 0.01 + 0.1 * (0.5 + rho_sign * (f - 0.5))
    curve = pd.concat([pd.DataFrame({"n": ns, "mode": mode, "dense_loss": 3.0, "relative_increase": rel.numpy(),
                                     "within_tolerance": (rel <= 0.05).numpy()}) for mode in ("renormalize", "delete")])
    heads = pd.DataFrame({"layer": torch.arange(3).repeat_interleave(4).numpy(),
                          "head": torch.arange(4).repeat(3).numpy(),
                          "n": 4, "f_score": f.flatten().numpy(), "loss_increase": increase.flatten().numpy()})
    windows = {"renormalize_loss": loss, "delete_loss": loss, "dense": dense, "weight": torch.full((n_windows,), 31.0),
               "head_increase": increase[..., None] + 0.001 * signs,
               **{f"head_{name}": f.expand(n_windows, 3, 4) + 0.01 * signs[:, None, None]
                  for name in ("f_score", "shell_k0", "shell_kn")}}
    return {"curve": curve, "heads": heads, "rho": {"f_score": rho_sign, "shell_k0": rho_sign, "shell_kn": rho_sign},
            "seq_len": seq_len, "windows": windows}


def test_claim7_reads_n_star_and_rho_on_their_intervals(tmp_path):
    from _reproduce.capacity import claim7, curve_intervals, rho_intervals

    study = _fake_study()
    tables = _capacity_tables(-1.0)
    spread = curve_intervals(tables)
    assert spread["n"] == [1, 2, 4, 8, 16] and spread["n_star"]["renormalize"].value == 4
    assert spread["smallest"].value == pytest.approx(0.01)  # N ≤ T/4 = 8
    assert spread["relative"]["renormalize"][1].value == pytest.approx(0.1)
    assert rho_intervals(tables)["f_score"].value == pytest.approx(-1.0)
    study.capacity = dict.fromkeys(("m1", "m2"), tables)
    claim = claim7(study, tmp_path)
    assert claim.verdict == HELD, claim.because
    assert "m1 ρ = -1.000 [-1.000, -1.000], N* = 4 [4, 4]" in claim.because
    study.capacity = {m: _capacity_tables(1.0) for m in ("m1", "m2")}
    wrong = claim7(study, tmp_path)  # the separable heads lose more: (b) not held
    assert wrong.verdict == PARTLY and any("> 0 on its whole interval" in n for n in wrong.disagreements)
    study.capacity = {m: _capacity_tables(-1.0, seq_len=8) for m in ("m1", "m2")}
    assert "N* (renormalised, within 5%) at most T/4 for 0/2 models" in claim7(study, tmp_path).because
    study.capacity = {m: {**_capacity_tables(-1.0), "windows": None} for m in ("m1", "m2")}
    assert claim7(study, tmp_path).verdict == NO_INTERVAL


def test_claim1_splits_the_net_effect_over_the_decomposition_nulls(tmp_path):
    from _reproduce.separability import claim1

    from tl_geometry import HeadAnalysis
    from tl_geometry.result import GROUPS, METRIC_NAMES

    study = _fake_study()
    assert not any("net effect decomposed" in str(b) for b in claim1(study, tmp_path).blocks)
    shuffled, cc = GROUPS.index("shuffled"), METRIC_NAMES.index("f_score_cc")
    for key, r in study.analyses.items():
        nulls = {}
        for i, kind in enumerate(("norms", "directions", "unselected")):
            scores = r.scores.clone()
            scores[shuffled, cc] = r.scores[0, cc] - 0.1 * (i + 1)  # top − null = 0.1, 0.2, 0.3
            nulls[kind] = HeadAnalysis(**{**vars(r), "scores": scores,
                                          "metadata": {**r.metadata, "shuffle": kind}})
        study.nulls[key] = nulls
    text = "\n".join(map(str, claim1(study, tmp_path).blocks))
    assert "The net effect decomposed" in text
    assert "| top − values | top − norms | top − directions | top − unselected |" in text
    assert "| m2 | c2 | 8 |" in text and "| 0.100 | 0.200 | 0.300 |" in text
    assert "| m1 | c1 | 16 |" not in text  # dense N stay out


def test_run_study_analyses_and_reuses_the_decomposition_nulls(tmp_path, monkeypatch):
    from _reproduce import study as study_module

    calls = []

    def fake_analyze(model, corpus, config, *, progress=True, kinds=("values",)):
        calls.append(list(kinds))
        out = {}
        for kind in kinds:
            out[kind] = r = _as_saved_today(_fake_study().analyses["m1", "c1"])
            r.metadata.update(shuffle=kind, window=None)
        return out

    monkeypatch.setattr(study_module, "analyze", fake_analyze)
    corpus = corpora.Corpus("c1", "text", "a fake corpus")
    kwargs = dict(models=("m1",), cache_dir=tmp_path, nulls=study_module.DECOMPOSITION_NULLS, log=lambda _: None)
    first = study_module.run_study({"m1": object()}, [corpus], QUICK, **kwargs)
    assert calls == [["values", "norms", "directions", "unselected"]]  # one forward for all four
    assert {k: r.shuffle for k, r in first.nulls["m1", "c1"].items()} == {
        "norms": "norms", "directions": "directions", "unselected": "unselected"}
    assert (tmp_path / "m1__c1__unselected.pt").exists()
    assert "analyze m1 c1 (+ norms, directions, unselected nulls)" in first.steps
    again = study_module.run_study({}, [corpus], QUICK, reuse=True, **kwargs)  # no model is loaded
    assert len(calls) == 1 and again.reused and set(again.nulls["m1", "c1"]) == set(first.nulls["m1", "c1"])
    # Only what is missing is computed again.
    (tmp_path / "m1__c1__directions.pt").unlink()
    third = study_module.run_study({"m1": object()}, [corpus], QUICK, reuse=True, **kwargs)
    assert calls[1:] == [["directions"]] and "analyze m1 c1 directions" in third.steps


def test_claim1_takes_each_gap_against_its_own_run_when_the_nulls_come_from_another_forward(tmp_path):
    """Nulls analysed in a later run (another machine's float32 forward: a few near-tied top-N
    sets differ) cannot share the main analysis's top-N scores: each gap is then read against
    its own run's top-N set, and the page says by how much the two runs' F∗(top) differ."""
    from _reproduce.separability import claim1

    from tl_geometry import HeadAnalysis
    from tl_geometry.result import GROUPS, METRIC_NAMES

    study = _fake_study()
    shuffled, cc = GROUPS.index("shuffled"), METRIC_NAMES.index("f_score_cc")
    for key, r in study.analyses.items():
        nulls = {}
        for i, kind in enumerate(("norms", "directions", "unselected")):
            scores = r.scores.clone()
            scores[0, cc] += 2e-5  # another forward: the top-N scores moved by a near-tie
            scores[shuffled, cc] = scores[0, cc] - 0.1 * (i + 1)
            nulls[kind] = HeadAnalysis(**{**vars(r), "scores": scores,
                                          "metadata": {**r.metadata, "shuffle": kind}})
        study.nulls[key] = nulls
    text = "\n".join(map(str, claim1(study, tmp_path).blocks))
    assert "| top − values | top − norms | top − directions | top − unselected |" in text
    assert "| m2 | c2 | 8 |" in text and "| 0.100 | 0.200 | 0.300 |" in text
    assert "each gap is taken against its own run's top-N set" in text and "up to 2.0e-05" in text


def test_run_study_recomputes_an_analysis_saved_before_sliding_windows(tmp_path, monkeypatch):
    """A saved analysis that records no windows predates SPEC §1's candidate sets: reused for a
    model without sliding windows (nothing changed there), recomputed for one with them."""
    from types import SimpleNamespace as NS

    from _reproduce import study as study_module

    calls = []

    def fake_analyze(model, corpus, config, *, progress=True, kinds=("values",)):
        calls.append(model.name)
        r = _as_saved_today(_fake_study().analyses["m1", "c1"])
        r.metadata.pop("window", None)  # as the engine saved it before windows were read
        return {"values": r}

    monkeypatch.setattr(study_module, "analyze", fake_analyze)
    corpus = corpora.Corpus("c1", "text", "a fake corpus")
    models = {"plain": NS(name="plain", config=NS(sliding_window=None, layer_types=["full_attention"] * 2)),
              "local": NS(name="local", config=NS(sliding_window=4,
                                                  layer_types=["sliding_attention", "full_attention"]))}
    kwargs = dict(models=tuple(models), cache_dir=tmp_path, log=lambda _: None)
    study_module.run_study(models, [corpus], QUICK, **kwargs)
    assert calls == ["plain", "local"]
    again = study_module.run_study(models, [corpus], QUICK, reuse=True, **kwargs)
    assert calls == ["plain", "local", "local"]  # only the windowed model's analysis is redone
    assert again.steps["analyze plain c1"].reused and not again.steps["analyze local c1"].reused


def test_saved_analyses_keep_the_slices_the_page_reads(tmp_path):
    """The study saves an analysis without its per-window arrays (any reader loads it) and the
    slices the page reads beside it, float32; loading puts them back in place, NaN elsewhere. A
    null keeps only the F∗ slices of its scores the page reads (NaN elsewhere); both files are
    deflated zips that torch.load reads."""
    import zipfile

    from _reproduce import saved
    from _reproduce.intervals import window_sink_values, window_values

    import tl_geometry
    from tl_geometry.result.schema import names

    r = _as_saved_today(_fake_study().analyses["m1", "c1"])
    r.window_scores = torch.rand(r.window_scores.shape, dtype=torch.float64)
    r.window_sink = torch.rand(r.window_sink.shape, dtype=torch.float64)
    r.window_bounds = torch.rand(r.window_bounds.shape, dtype=torch.float64)
    for kind in ("values", "norms"):
        path = tmp_path / f"{kind}.pt"
        saved.save(r, path, kind)
        plain = tl_geometry.HeadAnalysis.load(path)
        assert plain.window_scores is None
        assert (plain.sequence_votes is None) == (kind != "values")  # a null's votes are the main's
        back = saved.load(path, kind)
        assert back is not None
        if kind == "values":
            assert torch.equal(back.scores, r.scores)
        else:
            for group, metric in saved.NULL_SCORES:
                at = (names()["group"].index(group), names()["metric"].index(metric))
                assert torch.equal(back.scores[at], r.scores[at])
            kept = sum(back.scores[names()["group"].index(g), names()["metric"].index(m)].numel()
                       for g, m in saved.NULL_SCORES)
            assert int(back.scores.isnan().logical_not().sum()) == kept  # the rest NaN
        for file in (path, saved.windows_path(path)):
            with zipfile.ZipFile(file) as z:
                assert {i.compress_type for i in z.infolist()} == {zipfile.ZIP_DEFLATED}
        for group, metric in saved.kept(kind)["window_scores"]:
            want = window_values(r, metric, group).float().double()
            torch.testing.assert_close(window_values(back, metric, group), want, rtol=0, atol=0)
        assert window_values(back, "precision").isnan().all()  # not kept
        assert window_values(back, "f_score_cc", "sink_removed").isnan().all()
    values = saved.load(tmp_path / "values.pt", "values")
    assert values is not None
    torch.testing.assert_close(window_sink_values(values, "mass"),
                               window_sink_values(r, "mass").float().double(), rtol=0, atol=0)
    assert window_sink_values(values, "share").isnan().all()
    assert saved.load(tmp_path / "norms.pt", "values") is None  # a null keeps fewer slices than the main reads


def test_run_study_recomputes_what_todays_page_cannot_read(tmp_path, monkeypatch):
    """A saved analysis without per-window arrays (SPEC §8) or a sink check (SPEC §1), or whose
    windows started otherwise, is recomputed; saved ablation tables are reused only where
    today's analysis gives the taxonomy order they were ranked by, on windows that start alike."""
    import json

    from _reproduce import ablation as ablation_module
    from _reproduce import saved as saved_module
    from _reproduce import study as study_module

    calls = []

    def fake_analyze(model, corpus, config, *, progress=True, kinds=("values",)):
        calls.append("analyze")
        return {"values": _as_saved_today(_fake_study().analyses["m1", "c1"])}

    def fake_ablation(model, analysis, corpus, config, *, progress=True):
        calls.append("ablation")
        return _ablation_tables([0.01, 0.5, 0.4, 0.12], [0.005, 0.05, 0.8, 0.001])

    monkeypatch.setattr(study_module, "analyze", fake_analyze)
    monkeypatch.setattr(ablation_module, "run", fake_ablation)
    corpus = corpora.Corpus("c1", "text", "a fake corpus")
    kwargs = dict(models=("m1",), cache_dir=tmp_path, ablation_corpus=corpus, log=lambda _: None)
    monkeypatch.setattr(study_module, "_capacity_step", lambda *a: None)
    study_module.run_study({"m1": object()}, [corpus], QUICK, **kwargs)
    assert calls == ["analyze", "ablation"]
    study_module.run_study({"m1": object()}, [corpus], QUICK, reuse=True, **kwargs)
    assert calls == ["analyze", "ablation"]  # everything reused
    path = study_module.analysis_path(tmp_path, "m1", "c1")
    side = saved_module.windows_path(path)
    for spoil in ("window_scores", "window_bounds", "slice", "sink", "start"):
        saved = saved_module.load(path, "values")
        # Spoiled through the writer: the analysis records its side file's checksum, so a side
        # file edited in place is refused (tests/demos/test_uncertainty_and_side_files.py), not
        # recomputed.
        if spoil == "window_scores":  # no per-window slices beside the analysis
            side.unlink()
        elif spoil == "window_bounds":  # bounds saved, but not per window
            saved.window_bounds = None
            saved_module.save(saved, path, "values")
        elif spoil == "slice":  # fewer slices than the page reads (an older writer's)
            with monkeypatch.context() as older:
                older.setitem(saved_module.KEPT["values"], "window_scores",
                              [k for k in saved_module.KEPT["values"]["window_scores"] if k != ("top", "recall")])
                saved_module.save(saved, path, "values")
        elif spoil == "sink":
            del saved.metadata["sink"]
            saved_module.save(saved, path, "values")
        else:
            saved.metadata["reproduce_window_start"] = "bos"  # "m1" is unknown: its windows start with text
            saved_module.save(saved, path, "values")
        calls.clear()
        study_module.run_study({"m1": object()}, [corpus], QUICK, reuse=True, **kwargs)
        assert calls == ["analyze"], spoil  # the new analysis gives the same order: tables reused
    # Tables ranked by another taxonomy order are recomputed.
    stem = tmp_path / "m1__ablation"
    record = json.loads(Path(f"{stem}.json").read_text())
    Path(f"{stem}.json").write_text(json.dumps({**record, "taxonomy_order": [[9, 9]]}))
    calls.clear()
    study_module.run_study({"m1": object()}, [corpus], QUICK, reuse=True, **kwargs)
    assert calls == ["ablation"]


def test_claim1_share_of_heads_above_the_null_at_n2_has_its_interval_over_windows():
    """The share of heads with F∗(top) > F∗(shuffled) at N = 2 is a resampled statistic like the
    gap: its point is the share on the heads' means over every window, and its interval comes
    from the same resamples of windows (a per-query loop over heads as the reference)."""
    from types import SimpleNamespace

    from tl_geometry.result.schema import WINDOW_GROUPS, names

    g = torch.Generator().manual_seed(0)
    windows, layers, heads, ns = 12, 2, 5, [2, 4]
    scores = torch.rand(windows, len(WINDOW_GROUPS), len(names()["metric"]), layers, heads, len(ns),
                        generator=g, dtype=torch.float64)
    scores[:, WINDOW_GROUPS.index("top"), names()["metric"].index("f_score_cc"), 0, 0, 0] = math.nan
    r = SimpleNamespace(n_values=torch.tensor(ns), headline_n=ns, window_scores=scores, metadata={})
    sp = separability.spread(r)
    assert sp is not None and sp.above_at_2 is not None
    top = scores[:, WINDOW_GROUPS.index("top"), names()["metric"].index("f_score_cc"), ..., 0]
    shuffled = scores[:, WINDOW_GROUPS.index("shuffled"), names()["metric"].index("f_score_cc"), ..., 0]
    above = defined = 0
    for li in range(layers):
        for h in range(heads):
            gap = top[:, li, h].nanmean() - shuffled[:, li, h].nanmean()
            if not math.isnan(float(gap)):
                defined += 1
                above += float(gap) > 0
    assert defined == 9 and sp.above_at_2.value == pytest.approx(above / defined)
    assert sp.above_at_2.n == windows and sp.above_at_2.low <= sp.above_at_2.value <= sp.above_at_2.high
    # Without N = 2 among the headline N there is no share to resample.
    r4 = SimpleNamespace(n_values=torch.tensor([4, 8]), headline_n=[4, 8], window_scores=scores, metadata={})
    assert separability.spread(r4).above_at_2 is None
