"""Run the protocol of SPEC §8 on every model × corpus, and the ablation study of claim 6.

Each analysis is :func:`tl_geometry.analyze_model` (streaming: no cache is kept) on BOS + real
text windows, at the last query of each window, with N = 1, 2, 4, … below the window length,
16 random permutations and the bounds of SPEC §6. Results are saved next to their options so a
page can be re-rendered without recomputing (``--reuse``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import tl_geometry

from . import ablation as _ablation
from .corpora import Corpus
from .protocol import MODELS, StudyConfig, windows

#: Bytes allowed for one batch's logits (the forward pass computes them; Gemma's vocabulary is
#: 262k, so at 1024 tokens one window's logits alone take 1 GiB).
LOGITS_BUDGET = 1 << 30


@dataclass
class Study:
    """Everything the claims read: analyses per (model, corpus), ablation tables, timings."""

    config: StudyConfig
    corpora: dict[str, Corpus]
    analyses: dict[tuple[str, str], tl_geometry.HeadAnalysis]
    ablation: dict[str, dict[str, Any]] = field(default_factory=dict)  # model → tables
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)  # model → claim 7's tables
    seconds: dict[str, float] = field(default_factory=dict)  # step → seconds it took to compute
    reused: bool = False  # some steps were loaded from an earlier run (their seconds are that run's)

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(m for m, _ in self.analyses))

    @property
    def corpus_names(self) -> list[str]:
        return list(self.corpora)


def batch_size(model: Any, seq_len: int) -> int:
    """Windows per forward pass such that the batch's float32 logits stay within the budget."""
    d_vocab = int(getattr(model.cfg, "d_vocab", 50_000))
    return max(1, min(16, LOGITS_BUDGET // (seq_len * d_vocab * 4)))


def analyze(model: Any, corpus: Corpus, config: StudyConfig, *, progress: bool = True):
    """The head analysis of ``model`` on ``config.n_windows`` windows of ``corpus``."""
    tokens = windows(model, corpus, config.n_windows, config.seq_len)
    return tl_geometry.analyze_model(
        model, tokens, batch_size=batch_size(model, config.seq_len), n_values=config.n_values,
        queries="last", random_samples=config.random_samples, seed=config.seed, bounds=True,
        progress=progress,
    )


def run_study(
    load: Callable[[str], Any] | Mapping[str, Any],
    corpora: Sequence[Corpus],
    config: StudyConfig,
    *,
    models: Sequence[str] = MODELS,
    cache_dir: str | Path | None = None,
    reuse: bool = False,
    ablation_corpus: Corpus | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Study:
    """Analyse every model on every corpus, then run the ablation study on ``ablation_corpus``.

    ``load`` maps a model name to a loaded model (a dict of preloaded models, as the tests pass,
    or a loader such as :func:`tl_geometry.load_model`); each model is loaded once. With
    ``cache_dir``, analyses are saved there, and with ``reuse`` loaded back when their options
    match.
    """
    study = Study(config, {c.name: c for c in corpora}, {})
    cache = Path(cache_dir) if cache_dir is not None else None
    options = json.dumps(asdict(config), sort_keys=True)
    for name in models:
        model = None
        for corpus in corpora:
            path = None if cache is None else cache / f"{name}__{corpus.name}.pt"
            if reuse and path is not None and path.exists():
                saved = tl_geometry.HeadAnalysis.load(path)
                if saved.metadata.get("reproduce_options") == options:
                    log(f"{name} on {corpus.name}: reusing {path}")
                    study.analyses[name, corpus.name] = saved
                    study.seconds[f"analyze {name} {corpus.name}"] = saved.metadata["reproduce_seconds"]
                    study.reused = True
                    continue
            if model is None:
                start = time.perf_counter()
                model = load[name] if isinstance(load, Mapping) else load(name)
                study.seconds[f"load {name}"] = time.perf_counter() - start
            log(f"{name} on {corpus.name}: {config.n_windows} windows × {config.seq_len} tokens")
            start = time.perf_counter()
            result = analyze(model, corpus, config, progress=progress)
            study.seconds[f"analyze {name} {corpus.name}"] = time.perf_counter() - start
            result.metadata["reproduce_options"] = options
            result.metadata["reproduce_seconds"] = study.seconds[f"analyze {name} {corpus.name}"]
            if path is not None:
                result.save(path)
            study.analyses[name, corpus.name] = result
        if ablation_corpus is not None:
            model = _capacity_step(study, name, model, load, ablation_corpus, cache, reuse, options,
                                   progress, log)
            path = None if cache is None else cache / f"{name}__ablation"
            saved = _ablation.load(path) if reuse and path is not None else None
            if saved is not None and saved.get("options") == options:
                log(f"{name}: reusing the ablation tables in {cache}")
                study.ablation[name] = saved
                study.seconds[f"ablation {name}"] = saved["seconds"]
                study.reused = True
                continue
            if model is None:
                model = load[name] if isinstance(load, Mapping) else load(name)
            log(f"{name}: ablation study on held-out {ablation_corpus.name}")
            start = time.perf_counter()
            tables = _ablation.run(model, study.analyses[name, ablation_corpus.name],
                                   ablation_corpus, config, progress=progress)
            study.seconds[f"ablation {name}"] = time.perf_counter() - start
            tables["options"] = options
            tables["seconds"] = study.seconds[f"ablation {name}"]
            if path is not None:
                _ablation.save(tables, path)
            study.ablation[name] = tables
        del model
    return study


def _capacity_step(study: Study, name: str, model: Any, load: Any, corpus: Corpus, cache: Path | None,
                   reuse: bool, options: str, progress: bool, log: Callable[[str], None]) -> Any:
    """Claim 7's tables for one model (reused from ``cache`` when their options match); returns
    the model, loaded if it had to be."""
    from . import capacity as _capacity

    path = None if cache is None else cache / f"{name}__capacity"
    saved = _capacity.load(path) if reuse and path is not None else None
    if saved is not None and saved.get("options") == options:
        study.capacity[name], study.reused = saved, True
    else:
        if model is None:
            model = load[name] if isinstance(load, Mapping) else load(name)
        log(f"{name}: retrieval capacity (top-N attention) on held-out {corpus.name}")
        tables = _capacity.run(model, corpus, study.config, progress=progress)
        tables["options"] = options
        if path is not None:
            _capacity.save(tables, path)
        study.capacity[name] = tables
    study.seconds[f"capacity {name}"] = study.capacity[name]["seconds"]
    return model
