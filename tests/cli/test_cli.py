"""The ``tl-geometry`` command without a model: every bad argument ends in one line and exit 2
before any model load; the help; the subcommand registry; the progress default. Commands run on a
tiny model, and ``ablate --each`` once on the real SmolLM2."""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
from repo_paths import REPO

import tl_geometry
from tl_geometry import progress as _progress
from tl_geometry.cli import args as _cli_args
from tl_geometry.cli import main as cli
from tl_geometry.inputs import models

ROOT = REPO




@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    paths = {
        "empty": tmp_path / "empty.txt", "blank": tmp_path / "blank.txt", "short": tmp_path / "short.txt",
        "binary": tmp_path / "binary.bin", "latin1": tmp_path / "latin1.txt", "file": tmp_path / "file",
        "dir": tmp_path / "dir", "good": tmp_path / "good.txt",
    }
    paths["empty"].write_bytes(b"")
    paths["blank"].write_text(" \n\t \n")
    paths["short"].write_text("A few words only.")
    paths["binary"].write_bytes(bytes(range(256)) * 20)
    paths["latin1"].write_bytes("café au lait ".encode("latin-1") * 200)
    paths["file"].write_text("x")
    paths["dir"].mkdir()
    paths["good"].write_text("plenty of text here. " * 200)
    return paths


# (argv with {placeholders} for the files above, a phrase the one line must contain)
BAD = {
    "empty-text": ("analyze --text {empty}", "is empty"),
    "blank-text": ("analyze --text {blank}", "only whitespace"),
    "short-text": ("analyze --text {short}", "too short"),
    "folder-as-text": ("analyze --text {dir}", "not a regular file"),
    "missing-text": ("report --text {dir}/nope.txt", "does not exist"),
    "binary-text": ("analyze --text {binary}", "looks binary"),
    "latin1-text": ("ablate --heads 0.0 --text {latin1}", "not UTF-8"),
    "n-values-twice": ("analyze --n-values 2,2", "lists an N twice"),
    "n-values-negative": ("analyze --n-values -2,2", "every N must be ≥ 1"),
    "n-values-words": ("analyze --n-values two", "positive whole numbers"),
    "n-values-too-large": ("analyze --seq-len 8 --n-values 8,16", "every N is ≥ --seq-len"),
    "batch-size-0": ("analyze --batch-size 0", "--batch-size: must be ≥ 1"),
    "random-samples-0": ("analyze --random-samples 0", "--random-samples: must be ≥ 1"),
    "n-seqs-0": ("report --n-seqs 0", "--n-seqs: must be ≥ 1"),
    "seq-len-1": ("analyze --seq-len 1", "--seq-len 1 is too short"),
    "seq-len-2-report": ("report --seq-len 2", "use --seq-len 3 or more"),
    "save-under-a-file": ("analyze --save {file}/run.pt", "is a file, not a folder"),
    "save-a-folder": ("analyze --save {dir}", "is a folder; give a file name"),
    "csv-under-a-file": ("analyze --csv {file}/sub/t.csv", "is a file, not a folder"),
    "labels-suffix": ("analyze --labels {dir}/labels.txt", "must end in .csv or .json"),
    "labels-under-a-file": ("analyze --labels {file}/sub/l.csv", "is a file, not a folder"),
    "scores-csv-a-folder": ("scores --csv {dir}", "is a folder; give a file name"),
    "scores-top-without-sort": ("scores --top 3", "--top needs --sort"),
    "report-out-existing-file": ("report --out {file}", "is an existing file"),
    "prune-out-under-a-file": ("prune --out {file}/results", "is a file, not a folder"),
    "unknown-model": ("analyze --model gpt2", "Unknown model 'gpt2'"),
    "model-folder-without-config": ("report --model {dir}", "has no config.json"),
    "model-file-not-gguf": ("analyze --model {good}", "is not a GGUF file"),
    "heads-format": ("ablate --heads 3-4", "LAYER.HEAD pairs"),
    "heads-twice": ("ablate --heads 1.2,1.2", "twice"),
    "each-with-random-sets": ("ablate --heads 1.2 --each --n-random 3", "does not combine with --each"),
    "retention-range": ("prune --retention 1,1.5", "fractions in [0, 1]"),
    "n-random-0": ("prune --n-random 0", "must be ≥ 1"),
    "unknown-option": ("analyze --sequences 4", "unrecognized arguments"),
    "unknown-shuffle": ("analyze --shuffle keys", "invalid choice: 'keys'"),
    "no-command": ("", "required: COMMAND"),
}


def _argv(template: str, files: dict[str, Path]) -> list[str]:
    return template.format(**{k: str(v) for k, v in files.items()}).split()


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_argument_is_one_line_exit_2_before_any_model_load(case, files, no_model_load, capsys):
    template, phrase = BAD[case]
    with pytest.raises(SystemExit) as info:
        cli.main(_argv(template, files))
    out, err = capsys.readouterr()
    assert info.value.code == 2
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tl-geometry") and "error:" in lines[0]
    assert phrase in lines[0]
    assert "Traceback" not in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads and writes whatever the permissions say")
def test_unreadable_text_and_read_only_folder(files, tmp_path, no_model_load, capsys):
    files["good"].chmod(0)
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    try:
        for argv, phrase in ((["analyze", "--text", str(files["good"])], "cannot be read"),
                             (["analyze", "--save", str(locked / "r.pt")], "cannot write in")):
            with pytest.raises(SystemExit) as info:
                cli.main(argv)
            assert info.value.code == 2 and phrase in capsys.readouterr().err
    finally:
        files["good"].chmod(0o600)
        locked.chmod(0o700)


def test_a_real_process_exits_2_with_one_line_and_never_imports_transformers(files):
    """In a fresh interpreter: no traceback, one line per case, and transformers (which every
    model load needs) is never imported, so no model was loaded; nor is matplotlib."""
    cases = [_argv(BAD[c][0], files) for c in ("empty-text", "binary-text", "n-values-twice",
                                               "save-under-a-file", "report-out-existing-file",
                                               "unknown-model")]
    script = (
        "import sys\n"
        "from tl_geometry.cli.main import main\n"
        f"for argv in {cases!r}:\n"
        "    try:\n"
        "        main(argv)\n"
        "    except SystemExit as e:\n"
        "        print(e.code)\n"
        "print(*(m in sys.modules for m in ('transformers', 'transformer_lens', 'matplotlib')))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                          timeout=300, check=True)
    assert proc.stdout.split() == ["2"] * len(cases) + ["False"] * 3
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == len(cases) and all(" error: " in line for line in lines)
    assert "Traceback" not in proc.stderr
    bad = subprocess.run([sys.executable, "-m", "tl_geometry", "analyze", "--n-values", "2,2"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_ablate_heads_out_of_range_is_one_line_after_the_load(monkeypatch, capsys):
    """Head indices need the model's shape: checked after the load, reported the same way."""
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    with pytest.raises(SystemExit) as info:
        cli.main(["ablate", "--heads", "9.0", "--n-seqs", "1", "--seq-len", "8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2
    assert err[-1] == ("tl-geometry ablate: error: heads[0] = (9, 0): layer 9 is out of range; "
                       "the model has 3 layers (0..2).")


def test_ablate_prints_the_standard_error_and_the_random_sets(monkeypatch, capsys):
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    assert cli.main(["ablate", "--heads", "1.2,2.0", "--n-seqs", "3", "--seq-len", "10",
                     "--n-random", "3", "--same-layers"]) == 0
    out = capsys.readouterr().out
    assert "SE over 3 windows" in out and "3 random sets of 2 heads from the same layers" in out
    assert "empirical p = " in out


_EACH_LINE = re.compile(r"^  L(\d+)H(\d+)  loss \d+\.\d{4}  \(perplexity \d+\.\d{2}, "
                        r"Δ ([+-]\d+\.\d{4}) ± (\d+\.\d{4}) SE\)(  critical|  undecided)?$", re.M)


def test_ablate_each_prints_one_line_per_head_in_the_order_given(monkeypatch, capsys):
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    assert cli.main(["ablate", "--heads", "2.0,1.2", "--each", "--n-seqs", "3", "--seq-len", "10"]) == 0
    out = capsys.readouterr().out
    assert [(int(m[1]), int(m[2])) for m in _EACH_LINE.finditer(out)] == [(2, 0), (1, 2)]
    assert "one head at a time, zero-ablated (Δ ± SE over 3 windows)" in out


@pytest.mark.real_model
def test_ablate_each_on_smollm2_matches_head_sensitivity(smollm2, monkeypatch, capsys):
    """``--each`` on the real model: one line per head with its Δ loss ± SE over the windows, the
    numbers of ``head_sensitivity(heads=...)`` on the same windows; without it, one line for the
    heads together."""
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: smollm2.model)
    size = ["--n-seqs", "3", "--seq-len", "16"]
    assert cli.main(["ablate", "--heads", "1.4,0.8,3.2", "--each", *size]) == 0
    out = capsys.readouterr().out
    lines = list(_EACH_LINE.finditer(out))
    assert [(int(m[1]), int(m[2])) for m in lines] == [(1, 4), (0, 8), (3, 2)], out
    assert all(float(m[4]) > 0 for m in lines) and "over 3 windows" in out
    tokens = tl_geometry.text_windows(smollm2.model, n_seqs=3, seq_len=16)
    sens = tl_geometry.ablation.head_sensitivity(smollm2.model, tokens, heads=[(1, 4), (0, 8), (3, 2)],
                                                 progress=False)
    for m in lines:
        layer, head = int(m[1]), int(m[2])
        assert float(m[3]) == pytest.approx(float(sens.loss_increase[layer, head]), abs=1e-4)
        assert float(m[4]) == pytest.approx(float(sens.loss_increase_se[layer, head]), abs=1e-4)
    assert cli.main(["ablate", "--heads", "1.4,0.8,3.2", *size]) == 0
    together = capsys.readouterr().out
    assert not _EACH_LINE.search(together) and together.count("SE over 3 windows") == 1
    assert "zero-ablated L0H8, L1H4, L3H2: " in together  # the set, in layer order


# --- help ----------------------------------------------------------------------------------------
def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_option_has_help_defaults_and_examples():
    parser = cli.build_parser()
    top = parser.format_help()
    assert "The ``tl-geometry`` command" not in top and "docs/math.md" in top and "examples:" in top
    subs = _subparsers(parser)
    assert set(subs) == set(cli.COMMANDS)
    for name, sub in subs.items():
        text = sub.format_help()
        assert "examples:" in text and f"tl-geometry {name}" in text.split("examples:")[1], name
        assert "SPEC" not in text, name
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings} has no help"
            if action.default not in (None, True, False, argparse.SUPPRESS) and action.option_strings:
                assert "(default:" in sub._get_formatter()._format_action(action), action.dest
    analyze = " ".join(subs["analyze"].format_help().split())
    assert "1,2,4,8,16,32,64" in analyze and "separated by commas" in analyze


def test_defaults_parse_to_the_documented_values():
    args = cli.build_parser().parse_args(["analyze"])
    assert args.n_values == (1, 2, 4, 8, 16, 32, 64) and args.show_n == (2, 4, 8)
    assert args.model == models.DEFAULT_MODEL and args.progress is True
    assert cli.build_parser().parse_args(["analyze", "--no-progress"]).progress is False
    assert args.shuffle == "values"
    from tl_geometry.cli.analyze import SHUFFLE_CHOICES
    from tl_geometry.result.schema import SHUFFLE_KINDS

    assert SHUFFLE_CHOICES == SHUFFLE_KINDS
    prune = cli.build_parser().parse_args(["prune"])
    assert prune.retention == (1.0, 0.9, 0.75, 0.5, 0.25)


def test_each_registered_module_defines_add_parser_and_run():
    for command, module in cli.COMMANDS.items():
        assert callable(module.add_parser) and callable(module.run), command


def test_report_and_report_cli_do_not_import_each_other():
    """The report never imports the command, and the command imports the report (matplotlib,
    circuitsvis) only when it runs, never when the parser is built."""

    def imported(path: Path, *, top_level: bool) -> set[str]:
        tree = ast.parse(path.read_text())
        names = set()
        for node in tree.body if top_level else ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names.add(node.module or "")
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
        return names

    package = ROOT / "tl_geometry"
    assert not {n for n in imported(package / "views" / "report.py", top_level=False) if "cli" in n}
    assert not {n for n in imported(package / "cli" / "report.py", top_level=True) if "views" in n}
    from tl_geometry.cli import report as report_cli
    from tl_geometry.views import report

    assert report_cli.DEFAULT_OUT == report.DEFAULT_OUT
    assert cli.build_parser().parse_args(["report"]).out == report.DEFAULT_OUT


# --- progress default --------------------------------------------------------------------------
class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty

    def write(self, text: str) -> int:
        return len(text)


def test_auto_progress_terminal_notebook_and_pipe(monkeypatch):
    monkeypatch.delitem(sys.modules, "IPython", raising=False)
    monkeypatch.setattr(sys, "stderr", _Stream(tty=True))
    assert _progress.auto_progress() is True
    monkeypatch.setattr(sys, "stderr", _Stream(tty=False))
    assert _progress.auto_progress() is False
    fake = types.ModuleType("IPython")
    shell = types.SimpleNamespace()
    fake.get_ipython = lambda: shell  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "IPython", fake)
    assert _progress.auto_progress() is False  # terminal IPython piped: no kernel
    shell.kernel = object()
    assert _progress.auto_progress() is True  # a Jupyter kernel
    fake.get_ipython = lambda: None  # type: ignore[attr-defined]
    assert _progress.auto_progress() is False  # IPython imported, but not running
    monkeypatch.setattr(sys, "stderr", None)
    assert _progress.auto_progress() is False


def test_no_progress_option_wins_over_a_terminal(monkeypatch):
    """Progress is on unless --no-progress, on a terminal (a bar) and elsewhere (plain lines)."""
    monkeypatch.setattr(_progress, "auto_progress", lambda: True)
    parser = cli.build_parser()
    assert _cli_args.show_progress(parser.parse_args(["analyze"])) is True
    assert _cli_args.show_progress(parser.parse_args(["analyze", "--no-progress"])) is False
    monkeypatch.setattr(_progress, "auto_progress", lambda: False)
    assert _cli_args.show_progress(parser.parse_args(["report"])) is True
    assert _cli_args.show_progress(parser.parse_args(["report", "--no-progress"])) is False


#: The commands that run long enough to show progress, with their required arguments.
_LONG_COMMANDS = {"analyze": [], "report": [], "prune": [], "ablate": ["--heads", "1.2"], "capacity": [],
                  "scores": []}


@pytest.mark.parametrize("command", sorted(_LONG_COMMANDS))
def test_every_long_command_takes_no_progress(command):
    parser = cli.build_parser()
    assert parser.parse_args([command, *_LONG_COMMANDS[command]]).progress is True
    assert parser.parse_args([command, *_LONG_COMMANDS[command], "--no-progress"]).progress is False
    assert "--no-progress" in _subparsers(parser)[command].format_help()


def _progress_lines(err: str) -> list[str]:
    assert "\r" not in err and "\x1b" not in err  # no redrawn bar, no colour
    return [line for line in err.splitlines() if line.startswith("tl_geometry: ") and " elapsed" in line]


def test_a_command_logged_to_a_file_writes_progress_lines_and_no_progress_silences_them(monkeypatch, capsys):
    """Standard error captured (a file, not a terminal): plain progress lines from the start of the
    work to its end; none with --no-progress."""
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    monkeypatch.setattr(_progress, "_clock", lambda: 0.0)  # no time passes: the lines are exact
    argv = ["ablate", "--heads", "2.0,1.2", "--each", "--n-seqs", "3", "--seq-len", "10"]
    assert cli.main(argv) == 0
    assert _progress_lines(capsys.readouterr().err) == [  # both heads in one forward
        "tl_geometry: head sensitivity 0/2 heads (0 %), 0 s elapsed",
        "tl_geometry: head sensitivity 2/2 heads (100 %), 0 s elapsed"]
    assert cli.main([*argv, "--no-progress"]) == 0
    assert _progress_lines(capsys.readouterr().err) == []
    assert cli.main(["analyze", "--n-seqs", "2", "--seq-len", "10", "--n-values", "2,3"]) == 0
    assert _progress_lines(capsys.readouterr().err)[-1] == "tl_geometry: analyze_heads 3/3 layers (100 %), 0 s elapsed"


def test_no_progress_silences_library_bars_only_during_the_command(monkeypatch):
    seen = []
    monkeypatch.setattr(_progress, "auto_progress", lambda: True)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)

    def run(args):
        seen.append(os.environ.get("TQDM_DISABLE"))
        return 0

    from tl_geometry.cli import analyze as analyze_cli

    monkeypatch.setattr(analyze_cli, "run", run)
    assert cli.main(["analyze", "--no-progress"]) == 0
    assert cli.main(["analyze"]) == 0
    assert seen == ["1", None] and "TQDM_DISABLE" not in os.environ


def _tiny_with_tokenizer():
    from test_ablation import TinyLM

    class CharTokenizer:  # TinyLM's vocabulary is 40 ids; 0 is BOS
        bos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [1 + ord(c) % 39 for c in text]}

        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

    tiny = TinyLM().eval()
    tiny.tokenizer = CharTokenizer()
    return tiny


def test_prune_then_report_into_one_folder(monkeypatch, tmp_path, capsys):
    """The commands' wiring end to end on a tiny model: prune writes its tables, report reuses the
    folder and adds the Ablation section."""
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    out = tmp_path / "run"
    size = ["--n-seqs", "2", "--seq-len", "10", "--no-progress"]
    assert cli.main(["prune", *size, "--out", str(out), "--n-random", "1"]) == 0
    assert cli.main(["report", *size, "--out", str(out)]) == 0
    for name in ("sensitivity.csv", "sparsification.csv", "sensitivity.png", "index.html", "analysis.pt"):
        assert (out / name).stat().st_size > 0, name
    assert "<h2>Ablation</h2>" in (out / "index.html").read_text()
    assert "held-out loss by ordering" in capsys.readouterr().out


def test_a_model_folder_transformers_cannot_read_is_one_line(tmp_path, capsys):
    """Config, weights and tokenizer files present but unusable: found at the load, one line."""
    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    (folder / "tokenizer.json").write_text("{}")
    with pytest.raises(SystemExit) as info:
        cli.main(["analyze", "--model", str(folder), "--no-progress"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert info.value.code == 2 and "Traceback" not in "\n".join(lines)
    # The weights file is checked before transformers reads it: the message names the file.
    assert lines[-1].startswith(f"tl-geometry analyze: error: --model: Weights file {folder}")
    assert len(lines) == 1


def test_analyze_shuffle_picks_the_null_and_the_file_records_it(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    path = tmp_path / "norms.pt"
    argv = ["analyze", "--n-seqs", "2", "--seq-len", "10", "--n-values", "2,3", "--no-progress"]
    assert cli.main([*argv, "--shuffle", "norms", "--save", str(path)]) == 0
    assert tl_geometry.HeadAnalysis.load(path).shuffle == "norms"
    assert cli.main([*argv, "--save", str(path)]) == 0
    assert tl_geometry.HeadAnalysis.load(path).metadata["shuffle"] == "values"
