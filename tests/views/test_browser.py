"""A real browser opens the report offline: every widget renders, no network request is made,
and the screenshot is not blank. Needs Debian's chromium (``scripts/dev.sh`` installs it)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path
from typing import ClassVar

import pytest

from tl_geometry.cli import report as report_cli

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--no-first-run", "--disable-quic", "--disable-component-update", "--disable-sync",
         "--window-size=1400,3000",
         "--virtual-time-budget=8000"]  # React renders after load: let its timers run


@pytest.fixture(scope="module")
def chromium() -> str:
    if not Path(CHROMIUM).is_file():
        if os.environ.get("CI"):
            pytest.fail("chromium is missing on CI: scripts/dev.sh's system_deps should install it.")
        pytest.skip("chromium not installed (apt-get install chromium; scripts/dev.sh test does it)")
    return CHROMIUM


def _browse(chromium: str, page: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    profile = work / f"profile-{len(list(work.glob('profile-*')))}"  # a fresh profile every run
    return subprocess.run(
        [chromium, *FLAGS, f"--user-data-dir={profile}", *extra, page.as_uri()],
        capture_output=True, text=True, timeout=120, check=True,
    )


def _page_requests(net_log: Path) -> list[str]:
    """URLs the page itself requested (browser-internal requests have no initiating origin)."""
    log = json.loads(net_log.read_text())
    start = log["constants"]["logEventTypes"]["URL_REQUEST_START_JOB"]
    return [
        e["params"]["url"] for e in log["events"]
        if e["type"] == start and "url" in e.get("params", {})
        and e["params"].get("initiator") != "not an origin"
    ]


class _Widgets(HTMLParser):
    """Counts ``tlg-widget`` roots and how many element children each one has."""

    VOID: ClassVar[set[str]] = {"br", "img", "input", "meta", "link", "hr", "col", "area", "base", "wbr", "source"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[int | None] = []  # index into children, for open widget roots
        self.children: list[int] = []
        self.kinds: list[str] = []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        for open_root in {i for i in self.stack if i is not None}:
            self.children[open_root] += 1
        if tag in self.VOID:
            return
        if "tlg-widget" in (attrs.get("class") or "").split():
            self.children.append(0)
            self.kinds.append(attrs.get("data-component", "?"))
            self.stack.append(len(self.children) - 1)
        else:
            self.stack.append(None)

    def handle_endtag(self, tag):
        if tag not in self.VOID and self.stack:
            self.stack.pop()


@pytest.fixture(scope="module")
def report_dir(smollm2, tmp_path_factory) -> Path:
    """``tl-geometry report`` on small sizes, with the session's already-loaded SmolLM2."""
    out = tmp_path_factory.mktemp("report")
    args = argparse.Namespace(model="smollm2-135m", text=None, scores=False, n_seqs=2, seq_len=40, out=str(out),
                              no_bounds=False)
    mp = pytest.MonkeyPatch()
    mp.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: smollm2.model)
    try:
        assert report_cli.run(args) == 0
    finally:
        mp.undo()
    return out


@pytest.mark.real_model
def test_report_renders_offline_in_headless_chromium(chromium, report_dir, tmp_path):
    index = report_dir / "index.html"
    expected = index.read_text().count('class="tlg-widget')
    assert expected >= 5  # taxonomy, sink, and attention / contribution / tokens of example heads

    dom = _browse(chromium, index, tmp_path, "--dump-dom").stdout
    widgets = _Widgets()
    widgets.feed(dom)
    assert len(widgets.children) == expected, "every widget root must be in the rendered page"
    empty = [k for k, n in zip(widgets.kinds, widgets.children) if n == 0]
    assert not empty, f"widgets that did not render: {empty}"
    assert {"AttentionHeads", "ColoredTokens", "TaxonomyGrid", "SinkHeatmaps"} <= set(widgets.kinds)
    assert "Head Selector" in dom  # text only circuitsvis's React code writes

    shot, net_log = tmp_path / "report.png", tmp_path / "net.json"
    _browse(chromium, index, tmp_path, f"--screenshot={shot}", f"--log-net-log={net_log}")
    assert _page_requests(net_log) == [], "the report must not touch the network"
    import matplotlib.image

    pixels = matplotlib.image.imread(shot)[..., :3]
    assert pixels.shape[:2] == (3000, 1400)
    assert pixels.std() > 0.05 and (pixels.mean(-1) < 0.9).mean() > 0.02, "the screenshot is blank"
    if target := os.environ.get("TL_GEOMETRY_SCREENSHOT"):
        shutil.copy(shot, target)


def test_network_detector_sees_a_page_request(chromium, tmp_path):
    """The no-network assertion above can fail: a page with an external image is caught."""
    page = tmp_path / "leaky.html"
    page.write_text('<!DOCTYPE html><img src="https://tl-geometry.invalid/x.png"><p>leak</p>')
    net_log = tmp_path / "net.json"
    _browse(chromium, page, tmp_path, f"--log-net-log={net_log}", "--dump-dom")
    assert _page_requests(net_log) == ["https://tl-geometry.invalid/x.png"]
