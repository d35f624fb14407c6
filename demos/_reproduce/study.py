"""Run the protocol of SPEC §8 on every model × corpus, and the ablation and capacity studies.

Each analysis is :func:`tl_geometry.analyze_model` (streaming: no cache is kept) on BOS + real
text windows, at the last query of each window, with N = 1, 2, 4, … below the window length,
16 random permutations and the bounds of SPEC §6; beside it, from the same forward pass, one
analysis per decomposition null of SPEC §3 (norms, directions, unselected: same seed, no bounds,
no random baseline), which split the value-shuffle null's net effect. Every analysis keeps each
window's own means (``per_window=True``), which the bootstrap over windows of SPEC §8
resamples. Results are saved next to the page (one :meth:`~tl_geometry.HeadAnalysis.save`
file per model × corpus and per null, with the per-window slices the page reads beside it, see
:mod:`.saved`; CSV/JSON tables for the ablation and capacity studies)
with their options, how long they took, on how many threads and when, so that ``--reuse``
re-renders the page from them and says honestly how long the run took.
"""

from __future__ import annotations

import datetime
import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import tl_geometry
from tl_geometry.inputs.capture import model_windows
from tl_geometry.inputs.models import stated_bos

from . import ablation as _ablation
from . import saved as _saved
from .corpora import Corpus
from .protocol import ANALYSIS_FIELDS, MODELS, NO_ABLATION, STUDY_FIELDS, StudyConfig, windows

#: The decomposition nulls of SPEC §3 analysed beside each main analysis (whose ``shuffled``
#: group is the values null).
DECOMPOSITION_NULLS = ("norms", "directions", "unselected")

#: Bytes allowed for one batch's logits (the forward pass computes them; Gemma's vocabulary is
#: 262k, so at 1024 tokens one window's logits alone take 1 GiB).
LOGITS_BUDGET = 1 << 30

#: The GPU this process runs the models on (``reproduce.py --device cuda`` sets it), recorded
#: with every step it computes; None on the CPU.
ACCELERATOR: str | None = None


@dataclass
class Step:
    """How one step of the study (an analysis, an ablation or capacity study) was computed."""

    seconds: float
    threads: int | None = None  # torch CPU threads of the run that computed it (None: unrecorded)
    date: str | None = None  # when it was computed, UTC "YYYY-MM-DD HH:MM" (None: unrecorded)
    reused: bool = False  # loaded from an earlier run's saved results
    accelerator: str | None = None  # the GPU the models ran on (None: the CPU)

    @classmethod
    def now(cls, seconds: float) -> Step:
        """A step computed by this process, just now."""
        return cls(seconds, torch.get_num_threads(), _utc_now(), accelerator=ACCELERATOR)

    @classmethod
    def saved(cls, record: Mapping[str, Any]) -> Step:
        """A step loaded from a saved record (``seconds``, ``threads``, ``date``, ``accelerator``)."""
        return cls(float(record["seconds"]), record.get("threads"), record.get("date"), reused=True,
                   accelerator=record.get("accelerator"))

    def record(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "threads": self.threads, "date": self.date,
                "accelerator": self.accelerator}


def _utc_now() -> str:
    return f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"


@dataclass
class Study:
    """Everything the claims read: analyses per (model, corpus), ablation tables, timings."""

    config: StudyConfig
    corpora: dict[str, Corpus]
    analyses: dict[tuple[str, str], tl_geometry.HeadAnalysis]
    #: (model, corpus) → decomposition null → its analysis (SPEC §3); empty when not run.
    nulls: dict[tuple[str, str], dict[str, tl_geometry.HeadAnalysis]] = field(default_factory=dict)
    ablation: dict[str, dict[str, Any]] = field(default_factory=dict)  # model → tables
    capacity: dict[str, dict[str, Any]] = field(default_factory=dict)  # model → claim 7's tables
    steps: dict[str, Step] = field(default_factory=dict)  # step name → how it was computed

    @property
    def seconds(self) -> dict[str, float]:
        """Step name → seconds it took to compute (an earlier run's, for a reused step)."""
        return {k: s.seconds for k, s in self.steps.items()}

    @property
    def reused(self) -> bool:
        """Whether some step was loaded from an earlier run's saved results."""
        return any(s.reused for s in self.steps.values())

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


def analyze(model: Any, corpus: Corpus, config: StudyConfig, *, progress: bool = True,
            kinds: Sequence[str] = ("values",)) -> dict[str, tl_geometry.HeadAnalysis]:
    """The head analysis of ``model`` on ``config.n_windows`` windows of ``corpus`` for each null
    in ``kinds``, all from one forward pass (:func:`tl_geometry.analyze_model_nulls`):
    ``"values"`` is the main analysis, with the bounds and the random baseline; every other
    kind is that decomposition null's analysis (SPEC §3: same windows and seed, so the same
    top-N sets; no bounds and no random baseline, which it does not read). Every analysis keeps
    its per-window arrays (``per_window=True``: ``window_scores``, ``window_sink`` and, with the
    bounds, ``window_bounds``), which the page's intervals resample (SPEC §8)."""
    tokens = windows(model, corpus, config.n_windows, config.seq_len)
    return tl_geometry.analyze_model_nulls(
        model, tokens, nulls=kinds, batch_size=batch_size(model, config.seq_len), n_values=config.n_values,
        queries="last", random_samples=config.random_samples, seed=config.seed, bounds=True,
        per_window=True, progress=progress,
    )


def analysis_path(cache: Path, model: str, corpus: str, shuffle: str = "values") -> Path:
    """Where the analysis of ``model`` on ``corpus`` (or of one decomposition null) is saved."""
    return cache / (f"{model}__{corpus}.pt" if shuffle == "values" else f"{model}__{corpus}__{shuffle}.pt")


def run_study(
    load: Callable[[str], Any] | Mapping[str, Any],
    corpora: Sequence[Corpus],
    config: StudyConfig,
    *,
    models: Sequence[str] = MODELS,
    cache_dir: str | Path | None = None,
    reuse: bool = False,
    ablation_corpus: Corpus | None = None,
    nulls: Sequence[str] = (),
    no_ablation: Sequence[str] = NO_ABLATION,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> Study:
    """Analyse every model on every corpus (and, for each of ``nulls``, e.g.
    :data:`DECOMPOSITION_NULLS`, that null's analysis), then run the ablation and capacity
    studies on ``ablation_corpus`` for every model but those of ``no_ablation``.

    ``load`` maps a model name to a loaded model (a dict of preloaded models, as the tests pass,
    or a loader such as :func:`tl_geometry.load_model`); each model is loaded once. With
    ``cache_dir``, results are saved there, and with ``reuse`` loaded back when their options
    match and they read today's candidate sets (:func:`_same_windows`: an analysis saved before
    sliding windows were read is recomputed for a model that has them).
    """
    study = Study(config, {c.name: c for c in corpora}, {})
    cache = Path(cache_dir) if cache_dir is not None else None
    options = options_of(config)
    models_loaded: dict[str, Any] = {}

    def model_of(name: str) -> Any:
        if name not in models_loaded:
            start = time.perf_counter()
            models_loaded[name] = load[name] if isinstance(load, Mapping) else load(name)
            study.steps[f"load {name}"] = Step.now(time.perf_counter() - start)
        return models_loaded[name]

    def saved(name: str, corpus: Corpus, kind: str) -> tl_geometry.HeadAnalysis | None:
        """The analysis saved by an earlier run with these options and today's windows, or None."""
        what = "" if kind == "values" else f" ({kind} null)"
        path = None if cache is None else analysis_path(cache, name, corpus.name, kind)
        if not (reuse and path is not None and path.exists()):
            return None
        result = _saved.load(path, kind)
        if result is None:
            log(f"{name} on {corpus.name}{what}: {path} has no per-window slices beside it, or fewer than "
                "the page reads (SPEC §8's intervals resample them); recomputing")
            return None
        if not same_options(result.metadata.get("reproduce_options"), config, ANALYSIS_FIELDS):
            return None
        if not _same_windows(result, lambda: model_of(name)):
            log(f"{name} on {corpus.name}{what}: {path} was saved before sliding windows were read "
                "(SPEC §1); recomputing")
            return None
        stale = _stale_analysis(result, name)
        if stale:
            log(f"{name} on {corpus.name}{what}: {path} {stale}; recomputing")
            return None
        log(f"{name} on {corpus.name}{what}: reusing {path}")
        together = result.metadata.get("reproduce_together", [kind])
        if together[0] == kind:  # an analysis computed with others counts its forward once
            study.steps[_step_name(name, corpus.name, together)] = Step.saved(_analysis_record(result.metadata))
        return result

    def analyses(name: str, corpus: Corpus) -> dict[str, tl_geometry.HeadAnalysis]:
        """The main analysis and each null's: the saved ones reused, the others from one forward."""
        kinds = ("values", *nulls)
        found = {kind: result for kind in kinds if (result := saved(name, corpus, kind)) is not None}
        missing = [kind for kind in kinds if kind not in found]
        if not missing:
            return found
        model = model_of(name)
        log(f"{name} on {corpus.name} ({', '.join(missing)}): {config.n_windows} windows × {config.seq_len} tokens")
        start = time.perf_counter()
        computed = analyze(model, corpus, config, progress=progress, kinds=missing)
        step = study.steps[_step_name(name, corpus.name, missing)] = Step.now(time.perf_counter() - start)
        for kind, result in computed.items():
            result.metadata.update(reproduce_options=options, reproduce_together=missing,
                                   reproduce_window_start=window_start(name))
            result.metadata.update({f"reproduce_{k}": v for k, v in step.record().items()})
            if cache is not None:
                _saved.save(result, analysis_path(cache, name, corpus.name, kind), kind)
        return {kind: found[kind] if kind in found else computed[kind] for kind in kinds}

    for name in models:
        for corpus in corpora:
            found = analyses(name, corpus)
            study.analyses[name, corpus.name] = found.pop("values")
            if nulls:
                study.nulls[name, corpus.name] = found
        if ablation_corpus is not None and name not in no_ablation:
            _capacity_step(study, name, model_of, ablation_corpus, cache, reuse, options, progress, log)
            _ablation_step(study, name, model_of, ablation_corpus, cache, reuse, options, progress, log)
        models_loaded.clear()  # one model in memory at a time
    return study


def _step_name(model: str, corpus: str, kinds: Sequence[str]) -> str:
    """A step's name: ``analyze <model> <corpus>`` and the nulls computed in its forward."""
    name = f"analyze {model} {corpus}"
    extra = [kind for kind in kinds if kind != "values"]
    if "values" not in kinds:
        return f"{name} {', '.join(extra)}"
    return name + (f" (+ {', '.join(extra)} nulls)" if extra else "")


def _stale_tables(saved: Mapping[str, Any], model_name: str) -> str | None:
    """Why saved ablation or capacity tables cannot serve today's page: their windows started
    differently (None where they can)."""
    if saved.get("window_start", "bos") != window_start(model_name):
        return "read windows that start differently from today's (SPEC §1)"
    if saved.get("windows") is None:
        return "keep no per-window losses (SPEC §8's intervals resample them)"
    return None


def _has_windows(model: Any) -> bool:
    declared = model_windows(model)
    return declared is not None and any(w is not None for w in declared)


def _same_windows(saved: tl_geometry.HeadAnalysis, model: Callable[[], Any]) -> bool:
    """Whether a saved analysis read the candidate sets the study reads now (SPEC §1).

    An analysis saved before sliding windows were read records none (no ``"window"`` in its
    metadata); it is still right for a model without them (the engine's numbers are unchanged
    there, bit for bit), and is recomputed for a model whose config declares them (``model()``
    loads it to read the config).
    """
    if "window" in saved.metadata:
        return True
    return not _has_windows(model())


def window_start(model_name: str) -> str:
    """How the study's windows of ``model_name`` start today: ``"bos"`` or ``"text"`` (SPEC §1:
    BOS only where the model was trained with one). Tables saved before the rule record none;
    their windows all started with BOS."""
    return "bos" if stated_bos(model_name) else "text"


def _stale_analysis(saved: tl_geometry.HeadAnalysis, model_name: str) -> str | None:
    """Why a saved analysis cannot serve today's page (None where it can): the sink figures need
    its sink check (SPEC §1), and its windows must start as today's do. (Its per-window slices,
    which the intervals resample, :func:`.saved.load` has checked.)"""
    if "sink" not in saved.metadata:
        return "was saved before the sink was chosen and checked (SPEC §1)"
    if saved.metadata.get("reproduce_window_start", "bos") != window_start(model_name):
        return "read windows that start differently from today's (SPEC §1)"
    return None


def options_of(config: StudyConfig) -> str:
    """The options string saved with every result (a saved result is reused only on a match)."""
    return json.dumps(asdict(config), sort_keys=True)


def same_options(saved: str | None, config: StudyConfig, fields: Sequence[str]) -> bool:
    """Whether the options string ``saved`` (:func:`options_of`) agrees with ``config`` on
    ``fields``: an analysis is reused whatever the ablation study's sizes, and the other way
    round."""
    if saved is None:
        return False
    record, today = json.loads(saved), asdict(config)
    return all(record.get(f) == today[f] for f in fields)


def save_run(cache: Path, config: StudyConfig, seconds: float) -> None:
    """Record the whole run (wall time, model loading included) beside its saved results."""
    record = Step.now(seconds).record() | {"options": options_of(config)}
    cache.mkdir(parents=True, exist_ok=True)
    (cache / "run.json").write_text(json.dumps(record))


def load_run(cache: Path, config: StudyConfig) -> Step | None:
    """The whole-run record saved by :func:`save_run` for these options, or None."""
    path = cache / "run.json"
    if not path.exists():
        return None
    record = json.loads(path.read_text())
    return Step.saved(record) if record.get("options") == options_of(config) else None


def _analysis_record(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """The saved step record of an analysis (``reproduce_seconds``, ``_threads``, ``_date``)."""
    return {k: metadata.get(f"reproduce_{k}") for k in ("seconds", "threads", "date", "accelerator")}


def _ablation_step(study: Study, name: str, model_of: Callable[[str], Any], corpus: Corpus,
                   cache: Path | None, reuse: bool, options: str, progress: bool,
                   log: Callable[[str], None]) -> None:
    """Claim 6's tables for one model (reused from ``cache`` when their options match)."""
    path = None if cache is None else cache / f"{name}__ablation"
    saved = _ablation.load(path) if reuse and path is not None else None
    analysis = study.analyses[name, corpus.name]
    order = _ablation.taxonomy_heads(analysis)
    if saved is not None and not same_options(saved.get("options"), study.config, STUDY_FIELDS):
        saved = None
    if saved is not None:
        why = _stale_tables(saved, name)
        if why is None and saved.get("taxonomy_order") != order:
            why = "were ranked by a taxonomy order that today's analysis does not give"
        if why is not None:
            log(f"{name}: the saved ablation tables {why}; recomputing")
            saved = None
    if saved is not None:
        log(f"{name}: reusing the ablation tables in {cache}")
        study.ablation[name] = saved
        study.steps[f"ablation {name}"] = Step.saved(saved)
        return
    log(f"{name}: ablation study on held-out {corpus.name}")
    model = model_of(name)
    start = time.perf_counter()
    tables = _ablation.run(model, analysis, corpus, study.config, progress=progress)
    step = study.steps[f"ablation {name}"] = Step.now(time.perf_counter() - start)
    tables.update(step.record(), options=options, window_start=window_start(name),
                  taxonomy_order=order)
    if path is not None:
        _ablation.save(tables, path)
    study.ablation[name] = tables


def _capacity_step(study: Study, name: str, model_of: Callable[[str], Any], corpus: Corpus,
                   cache: Path | None, reuse: bool, options: str, progress: bool,
                   log: Callable[[str], None]) -> None:
    """Claim 7's tables for one model (reused from ``cache`` when their options match)."""
    from . import capacity as _capacity

    path = None if cache is None else cache / f"{name}__capacity"
    saved = _capacity.load(path) if reuse and path is not None else None
    if saved is not None and not same_options(saved.get("options"), study.config, STUDY_FIELDS):
        saved = None
    if saved is not None:
        why = _stale_tables(saved, name)
        if why is None and not saved.get("windows_read") and _has_windows(model_of(name)):
            why = "were computed before capacity_correlation read sliding windows"
        if why is not None:
            log(f"{name}: the saved capacity tables {why}; recomputing")
            saved = None
    if saved is not None:
        log(f"{name}: reusing the capacity tables in {cache}")
        study.capacity[name] = saved
        study.steps[f"capacity {name}"] = Step.saved(saved)
        return
    log(f"{name}: retrieval capacity (top-N attention) on held-out {corpus.name}")
    tables = _capacity.run(model_of(name), corpus, study.config, progress=progress)
    step = study.steps[f"capacity {name}"] = Step.now(tables["seconds"])
    tables.update(step.record(), options=options, window_start=window_start(name), windows_read=True)
    if path is not None:
        _capacity.save(tables, path)
    study.capacity[name] = tables
