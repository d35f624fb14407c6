"""One source for the analysis options: the three entry points take the same keywords
(``AnalysisArgs``), the CLI's choices come from the same ``Literal`` types, and an unknown
keyword names the function and the options it takes."""

from __future__ import annotations

import inspect
from typing import get_args

import pytest
from cases import make_case

import tl_geometry
from tl_geometry.engine.options import (
    OPTION_NAMES,
    AnalysisArgs,
    Distance,
    QueryRule,
    check_options,
)


def test_the_three_entry_points_take_the_analysis_options_as_one_type():
    for entry in (tl_geometry.analyze_heads, tl_geometry.analyze_model, tl_geometry.analyze_model_nulls):
        options = inspect.signature(entry).parameters["options"]
        assert options.kind is inspect.Parameter.VAR_KEYWORD
        assert "AnalysisArgs" in str(options.annotation), entry.__name__
    assert set(OPTION_NAMES) == set(inspect.signature(check_options).parameters)
    assert tuple(AnalysisArgs.__annotations__) == OPTION_NAMES


def test_options_reach_the_engine_with_check_options_defaults():
    cache = make_case(0).cache()
    with pytest.warns(UserWarning, match="cannot be evaluated"):  # the default N up to 64 on 12 keys
        default = tl_geometry.analyze_heads(cache, random_samples=2, shuffle_samples=2)
    assert default.metadata["n_values"] == list(check_options().n_values.tolist())
    chosen = tl_geometry.analyze_heads(cache, n_values=(1, 2), queries="all", random_samples=2,
                                       shuffle_samples=2, seed=3, distance="cosine")
    assert chosen.n_values.tolist() == [1, 2] and chosen.metadata["queries"] == "all"
    assert chosen.metadata["distance"] == "cosine" and chosen.metadata["seed"] == 3


@pytest.mark.parametrize("entry", ["analyze_heads", "analyze_model", "analyze_model_nulls"])
def test_an_unknown_keyword_names_the_function_and_its_options(entry):
    args = (make_case(0).cache(),) if entry == "analyze_heads" else (object(), "text")
    with pytest.raises(TypeError, match=rf"{entry}\(\) got unexpected keyword argument\(s\) 'n_value'; "
                                        r"its analysis options are n_values, queries"):
        getattr(tl_geometry, entry)(*args, n_value=(1, 2))


def test_analyze_model_nulls_sets_the_shuffle_itself():
    with pytest.raises(TypeError, match=r"'shuffle'; its analysis options are n_values.*seed"):
        tl_geometry.analyze_model_nulls(object(), "text", shuffle="norms")


def test_cli_choices_come_from_the_option_types():
    import argparse

    from tl_geometry.analyze.from_model import ATTENTION_SOURCES, AttentionSource
    from tl_geometry.cli import analyze as cli_analyze

    parser = argparse.ArgumentParser()
    cli_analyze.add_parser(parser.add_subparsers(), "analyze")
    actions = {a.dest: a for a in parser._subparsers._group_actions[0].choices["analyze"]._actions}
    assert [actions["queries"].type(x) for x in get_args(QueryRule)] == list(get_args(QueryRule))
    assert actions["queries"].type("256") == 256 and check_options(queries=256).queries == 256
    assert tuple(actions["distance"].choices) == get_args(Distance)
    assert tuple(actions["attention"].choices) == ATTENTION_SOURCES == get_args(AttentionSource)
    # No CLI default for R: the analysis's own (16 at the last query, 4 with more; SPEC §3).
    assert actions["random_samples"].default is None is actions["shuffle_samples"].default
    assert (check_options().random_samples, check_options(queries="all").random_samples) == (16, 4)
    assert check_options(queries=8, random_samples=0).shuffle_samples == 4
