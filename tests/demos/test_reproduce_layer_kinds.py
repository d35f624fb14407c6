"""The page reads a model's global and local layers apart (SPEC §8 (i)): the study the claims see
splits such a model into two runs, the size section names them, and claim 5 compares only the
global layers with the paper's Gemma-7B."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from repo_paths import REPO, TESTS

sys.path.insert(0, str(REPO / "demos"))
sys.path.insert(0, str(TESTS))

from _reproduce import corpora, layer_kinds, sizes, taxonomy
from _reproduce.protocol import QUICK
from _reproduce.study import Study
from result_fakes import fake


def _study() -> Study:
    """One model with sliding-window layers (layers 0 and 2 local, 1 global) and one without."""
    windows = {"gemma3-270m": [4, None, 4], "smollm2-135m": [None, None, None]}
    analyses, nulls = {}, {}
    for model, window in windows.items():
        for corpus in ("c1", "c2"):
            r = fake(layers=(0, 1, 2), metadata={"n_positions": 48, "n_sequences": 3, "window": window})
            analyses[model, corpus] = r
            nulls[model, corpus] = {"norms": fake(layers=(0, 1, 2), metadata={"window": window})}
    texts = {c: corpora.Corpus(c, "text", "a fake corpus") for c in ("c1", "c2")}
    return Study(QUICK, texts, analyses, nulls=nulls, ablation={"gemma3-270m": {"x": 1}})


def test_a_model_with_both_kinds_becomes_two_runs_and_the_rest_stays():
    study = _study()
    runs = layer_kinds.split(study)
    assert runs.models == ["gemma3-270m · global", "gemma3-270m · local", "smollm2-135m"]
    assert runs.analyses["gemma3-270m · global", "c1"].layers == (1,)
    assert runs.analyses["gemma3-270m · local", "c2"].layers == (0, 2)
    torch.testing.assert_close(runs.analyses["gemma3-270m · local", "c1"].scores,
                               study.analyses["gemma3-270m", "c1"].scores[:, :, [0, 2]])
    assert runs.nulls["gemma3-270m · local", "c1"]["norms"].layers == (0, 2)
    assert runs.analyses["smollm2-135m", "c1"] is study.analyses["smollm2-135m", "c1"]
    assert list(study.analyses) == [(m, c) for m in ("gemma3-270m", "smollm2-135m") for c in ("c1", "c2")]
    assert (layer_kinds.base("gemma3-270m · local"), layer_kinds.kind("gemma3-270m · local")) == \
        ("gemma3-270m", "local")
    assert layer_kinds.kind("smollm2-135m") is None
    # The size section names each kind by its model's size; claims 6 and 7 read the whole model.
    assert sizes.size_of("gemma3-270m · global") == "270M global" and sizes.size_of("smollm2-135m") == "135M"
    assert sizes.one_model(runs, "gemma3-270m · local").ablation == {"gemma3-270m": {"x": 1}}


def test_claim5_compares_only_global_layers_with_the_paper_gemma():
    dominant = {("gemma3-270m · global", "c1"): "Mixer", ("gemma3-270m · global", "c2"): "Mixer",
                ("gemma3-270m · local", "c1"): "Reset", ("gemma3-270m · local", "c2"): "Reset",
                ("smollm2-135m", "c1"): "Reset"}
    readings = taxonomy._gemma_readings(dominant)
    assert readings == [
        "gemma3-270m · global is Mixer / Mixer-dominated (per corpus), as the paper found Mixers in Gemma",
        "gemma3-270m · local is Reset / Reset-dominated (per corpus): sliding-window layers, which the "
        "paper's Gemma-7B does not have, so no comparison",
    ]
    assert not any("not Mixer-dominated" in x for x in readings)
    reset_global = {**dominant, ("gemma3-270m · global", "c2"): "Reset"}
    assert "where the paper found Mixers" in taxonomy._gemma_readings(reset_global)[0]


def test_a_split_model_is_one_size_and_an_unmeasured_claim_has_no_level():
    from _reproduce import ablation, capacity
    from _reproduce.intervals import NOT_MEASURED

    models = ["smollm2-135m", "gemma3-270m · global", "gemma3-270m · local", "qwen2.5-coder-0.5b"]
    # The two kinds agree: read across sizes as one model.
    assert sizes.across_sizes(["held", "held", "held", "not held"], models) == "weakens as size grows"
    # They disagree: the claim moves with the kind of layer, not with size.
    assert sizes.across_sizes(["held", "held", "not held", "held"], models).startswith("reads differently")
    # No step between the two kinds of one model counts as a step in size.
    assert sizes.across_sizes(["held", "not held", "held", "held"], models) != "moves without a trend"
    assert sizes.across_sizes(["held", "partly held"], ["a", "b"]) == sizes.direction(["held", "partly held"])
    # One kind without a level (too few): no direction, not "reads differently".
    assert sizes.across_sizes(["held", "too few", "partly held", "held"], models).startswith("has no direction")
    # A model without an ablation or capacity study: not measured, no level to read.
    study = Study(QUICK, {}, {})
    assert ablation.claim6(study, Path(".")).verdict == NOT_MEASURED
    assert capacity.claim7(study, Path(".")).verdict == NOT_MEASURED
    assert sizes.direction(["held", NOT_MEASURED]).startswith("has no direction")
