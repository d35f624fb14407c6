"""Progress where standard error is not a terminal: plain lines (no carriage return, no colour)
at the start, at every tenth of the work and at the first step 30 s or more after the last line;
a bar on a terminal; nothing with ``progress=False`` (or ``None`` where no bar is visible)."""

from __future__ import annotations

import pytest
from cases import make_case

import tl_geometry
from tl_geometry import progress as _progress


class _Clock:
    """A clock that moves only when told: the lines' times are deterministic."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    fake = _Clock()
    monkeypatch.setattr(_progress, "_clock", fake)
    return fake


def _plain(err: str) -> list[str]:
    assert "\r" not in err and "\x1b" not in err  # no redrawn bar, no colour
    return [line for line in err.splitlines() if line.startswith("tl_geometry: ") and "elapsed" in line]


def _analyze(n_layers: int, progress):
    case = make_case(4)
    cache = {}
    for layer in range(n_layers):
        cache.update(case.cache(layer))
    return tl_geometry.analyze_heads(cache, n_values=(1, 2), random_samples=1, backend="torch", progress=progress)


def test_an_analysis_logged_to_a_file_writes_plain_lines(clock, capsys):
    """``progress=True`` with standard error captured (not a terminal): a line at the start and
    one per tenth of the layers (every layer, with fewer than ten)."""
    _analyze(4, True)
    assert _plain(capsys.readouterr().err) == [
        f"tl_geometry: analyze_heads {n}/4 layers ({25 * n} %), 0 s elapsed" for n in range(5)]


@pytest.mark.parametrize("progress", [False, None])
def test_no_progress_and_the_automatic_default_write_nothing_off_a_terminal(progress, clock, capsys):
    _analyze(2, progress)
    assert _plain(capsys.readouterr().err) == []


def test_a_line_every_tenth_of_the_work_or_every_30_s(clock, capsys):
    lines = _progress.ProgressLines(100, "head sensitivity", "head")
    for _ in range(20):  # 1 s per step: the tenths decide
        clock.now += 1
        lines.update()
    clock.now += 29
    lines.update()  # 29 s after the last line and no new tenth: nothing
    clock.now += 1
    lines.update()  # 30 s: a line
    clock.now += 50
    lines.update(8)  # both: one line
    lines.close()
    assert _plain(capsys.readouterr().err) == [
        "tl_geometry: head sensitivity 0/100 heads (0 %), 0 s elapsed",
        "tl_geometry: head sensitivity 10/100 heads (10 %), 10 s elapsed",
        "tl_geometry: head sensitivity 20/100 heads (20 %), 20 s elapsed",
        "tl_geometry: head sensitivity 22/100 heads (22 %), 50 s elapsed",
        "tl_geometry: head sensitivity 30/100 heads (30 %), 1 min 40 s elapsed",
    ]


def test_lines_name_the_stage_and_count_an_iterable_of_unknown_length(clock, capsys):
    lines = _progress.ProgressLines(2, "tl-geometry report", "stage", postfix="load model")
    lines.set_postfix_str("forward")
    clock.now = 3725
    lines.update()
    for _ in _progress.progress_bar(iter(range(2)), True, "analyze_model", "batch"):
        pass
    assert _plain(capsys.readouterr().err) == [
        "tl_geometry: tl-geometry report 0/2 stages (0 %), 0 s elapsed; load model",
        "tl_geometry: tl-geometry report 1/2 stages (50 %), 1 h 02 min elapsed; forward",
        "tl_geometry: analyze_model 0 batches, 0 s elapsed",
    ]


def test_a_terminal_keeps_the_bar(monkeypatch, capsys):
    from tqdm.auto import tqdm

    monkeypatch.setattr(_progress, "auto_progress", lambda: True)
    bar = _progress.progress_bar(range(3), True, "analyze_heads", "layer")
    counter = _progress.progress_counter(3, "head sensitivity", "head")
    assert isinstance(bar, tqdm) and isinstance(counter, tqdm)
    list(bar)
    counter.close()
    err = capsys.readouterr().err
    assert "analyze_heads" in err and "tl_geometry: " not in err  # the bars, and no plain line
    monkeypatch.setattr(_progress, "auto_progress", lambda: False)
    assert isinstance(_progress.progress_counter(3, "head sensitivity", "head"), _progress.ProgressLines)
