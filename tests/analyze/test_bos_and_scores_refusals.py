"""Which token a window starts with (the loader's BOS flag), what ``head_scores`` refuses, and
what the ``scores`` / ``analyze`` commands and ``scripts/dev.sh setup`` refuse before any load.

Most tests run on a tiny hooked model with a character tokenizer whose BOS flag is set either
way; the real-model tests use the session fixtures (SmolLM2, Gemma-3) and never load again.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import subprocess
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from repo_paths import REPO
from shared_checks import spy_head_score_inputs
from test_ablation import TinyLM

import tl_geometry
from tl_geometry.cli import main as cli
from tl_geometry.inputs import models
from tl_geometry.inputs.gguf_header import read_gguf_info

# The module (tl_geometry.analyze.head_scores is the function of the same name).
_head_scores = importlib.import_module("tl_geometry.analyze.head_scores")
ROOT = REPO
BOS, EOS, PAD = 0, 1, 2


# --- a tiny model whose tokenizer says BOS either way -------------------------------------------
class CharTokenizer:
    """One id per character (3..39); BOS 0, EOS 1 and a dedicated pad 2 (or pad = EOS)."""

    bos_token_id, eos_token_id = BOS, EOS
    add_bos_token = True  # what a converted tokenizer may claim: never read

    def __init__(self, trained_with_bos: bool | None, pad: int | None = PAD) -> None:
        if trained_with_bos is not None:
            self.tl_geometry_bos = trained_with_bos
        self.pad_token_id = pad
        self.all_special_ids = [BOS, EOS, PAD]

    def __len__(self) -> int:
        return 40

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [3 + ord(c) % 37 for c in text]}


def tiny(trained_with_bos: bool | None, pad: int | None = PAD) -> TinyLM:
    model = TinyLM().eval()
    model.tokenizer = CharTokenizer(trained_with_bos, pad)
    return model


def text_ids(n: int) -> list[int]:
    return CharTokenizer(True)(tl_geometry.sample_text())["input_ids"][:n]


def write_gguf(path: Path, add_bos: bool | None) -> Path:
    """A small valid GGUF file, with or without ``tokenizer.ggml.add_bos_token``."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(64)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# --- 1. the model table's BOS flag, and the user's own files --------------------------------------
def test_model_table_records_bos_per_builtin_model():
    assert {name: spec.bos for name, spec in models.MODELS.items()} == {
        "smollm2-135m": True, "gemma3-270m": True,
        "qwen2.5-coder-0.5b": False, "qwen2.5-coder-1.5b": False,
    }
    for name, spec in models.MODELS.items():
        assert models.trained_with_bos(name) is spec.bos


@pytest.mark.parametrize("stated", [True, False])
def test_a_gguf_file_and_a_folder_say_it_themselves(tmp_path, stated):
    path = write_gguf(tmp_path / "m.gguf", stated)
    assert read_gguf_info(path).add_bos_token is stated
    assert models.trained_with_bos(path) is stated
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": stated}))
    assert models.trained_with_bos(folder) is stated


def test_files_that_do_not_say_mean_no_bos_with_a_warning_naming_the_fix(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", None)
    assert read_gguf_info(path).add_bos_token is None
    folder = tmp_path / "f"
    folder.mkdir()
    (folder / "tokenizer_config.json").write_text("{}")
    for where in (path, folder):
        with pytest.warns(UserWarning, match="tl_geometry_bos = True"):
            assert models.trained_with_bos(where) is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert models.trained_with_bos(path, warn=False) is False
    with pytest.raises(models.ModelLoadError, match="Unknown model"):
        models.trained_with_bos(tmp_path / "nothing-here")


def test_the_loader_marks_the_tokenizer_from_the_source_not_the_tokenizer(tmp_path):
    """A GGUF file saying False wins over a tokenizer that claims add_bos_token = True (as
    transformers' conversion of Qwen2.5-Coder's GGUF does); a built-in goes by the table."""
    tokenizer = CharTokenizer(None)
    path = write_gguf(tmp_path / "q.gguf", False)
    models._mark_bos(tokenizer, models._Source("q", path.parent, path.name, None))
    assert tokenizer.tl_geometry_bos is False and tokenizer.add_bos_token is True
    for name, spec in models.MODELS.items():
        models._mark_bos(tokenizer, models._Source(name, Path(), spec.gguf_name, name))
        assert tokenizer.tl_geometry_bos is spec.bos


def test_a_model_loaded_elsewhere_falls_back_to_the_table_by_name():
    """No attribute: the built-in table by ``cfg.model_name`` (a Qwen2.5-Coder model whose
    converted tokenizer says add_bos_token = True still gets no BOS); nothing: no BOS, warned."""
    model = tiny(None)
    model.cfg.model_name = "qwen2.5-coder-0.5b"
    assert models.trained_with_bos(model) is False
    model.cfg.model_name = "gemma3-270m"
    assert models.trained_with_bos(model) is True
    with pytest.warns(UserWarning, match="tl_geometry_bos"):
        assert models.trained_with_bos(tiny(None)) is False


@pytest.mark.parametrize("with_bos", [True, False])
def test_text_windows_prepend_bos_only_where_the_model_was_trained_with_one(with_bos):
    model = tiny(with_bos)
    for source in (model, model.tokenizer):
        windows = tl_geometry.text_windows(source, n_seqs=3, seq_len=16)
        assert windows.shape == (3, 16)
        if with_bos:
            body = torch.tensor(text_ids(3 * 15)).reshape(3, 15)
            assert torch.equal(windows, torch.cat([torch.full((3, 1), BOS), body], 1))
        else:
            assert torch.equal(windows, torch.tensor(text_ids(3 * 16)).reshape(3, 16))
    need = "need 48" if not with_bos else "need 45"
    with pytest.raises(ValueError, match=need):
        tl_geometry.text_windows(model, "x" * 44, n_seqs=3, seq_len=16)


@pytest.mark.real_model
def test_real_windows_keep_bos_and_the_loader_records_it(real):
    """SmolLM2 and Gemma-3: BOS first, then the text's own tokens, exactly as before."""
    tokenizer = real.model.tokenizer
    assert real.model.tl_geometry_bos is True and tokenizer.tl_geometry_bos is True
    assert real.model.tl_geometry_loading["trained_with_bos"] is True
    ids = tokenizer(tl_geometry.sample_text(), add_special_tokens=False)["input_ids"]
    windows = tl_geometry.text_windows(real.model, n_seqs=2, seq_len=24)
    want = torch.cat([torch.full((2, 1), tokenizer.bos_token_id),
                      torch.tensor(ids[:46]).reshape(2, 23)], 1)
    assert torch.equal(windows, want)
    assert torch.equal(real.tokens, tl_geometry.text_windows(tokenizer, n_seqs=real.tokens.shape[0],
                                                             seq_len=real.tokens.shape[1]))


# --- 2. head_scores: the sequences it builds and the ones it refuses --------------------------------
@pytest.mark.parametrize("with_bos", [True, False])
def test_built_sequences_start_as_the_model_was_trained(monkeypatch, with_bos):
    seen = spy_head_score_inputs(monkeypatch)
    scores = tl_geometry.head_scores(tiny(with_bos), seed=3)
    repeated, windows, sink, needled, *chosen = seen
    # Trained without BOS: the sink is each window's most attended first token (sink="auto", SPEC
    # §1), read in one more forward of the same windows.
    assert (not chosen) if with_bos else (len(chosen) == 1 and torch.equal(chosen[0], windows))
    assert ("sink_rate_selected" in scores.columns) is not with_bos
    R = scores.attrs["repeat"]
    assert R == 32 and scores.attrs["trained_with_bos"] is with_bos
    assert repeated.shape == (8, 2 * R + with_bos) and windows.shape == (8, 128) and sink.shape == (8, 64)
    assert bool((repeated[:, 0] == BOS).all()) is with_bos and bool((windows[:, 0] == BOS).all()) is with_bos
    assert not ((repeated[:, 1:] <= PAD).any() or (windows[:, 1:] <= PAD).any())
    start = int(with_bos)
    assert torch.equal(repeated[:, start:start + R], repeated[:, start + R:])
    assert needled.shape == (8, 128 + 32 + 16)


def test_scores_without_bos_read_the_positions_of_section_9(monkeypatch):
    """No BOS: the copies start at 0; previous-token over t = 1 … 2R−1, duplicate and induction
    over the second copy t = R … 2R−1 (an independent loop over the same patterns)."""
    model = tiny(False)
    g = torch.Generator().manual_seed(5)
    R = 6
    body = torch.randint(3, 40, (2, R), generator=g)
    repeated = torch.cat([body, body], 1)
    windows = tl_geometry.text_windows(model, n_seqs=2, seq_len=16)
    scores = tl_geometry.head_scores(model, repeated=repeated, windows=windows)
    with torch.no_grad():
        _, cache = model.run_with_cache(repeated)
    for layer in range(model.cfg.n_layers):
        p = cache[f"blocks.{layer}.attn.hook_pattern"].double()
        for head in range(model.cfg.n_heads):
            row = scores[(scores.layer == layer) & (scores["head"] == head)].iloc[0]
            q = p[:, head]
            prev = np.mean([float(q[b, t, t - 1]) for b in range(2) for t in range(1, 2 * R)])
            dup = np.mean([float(q[b, t, t - R]) for b in range(2) for t in range(R, 2 * R)])
            ind = np.mean([float(q[b, t, t - R + 1]) for b in range(2) for t in range(R, 2 * R)])
            assert row.previous_token == pytest.approx(prev, abs=1e-12)
            assert row.duplicate_token == pytest.approx(dup, abs=1e-12)
            assert row.induction == pytest.approx(ind, abs=1e-12)


def test_many_windows_run_in_batches_with_the_same_scores(monkeypatch):
    model = tiny(True)
    windows = tl_geometry.text_windows(model, n_seqs=5, seq_len=24)
    whole = tl_geometry.head_scores(model, windows=windows, seed=2)
    monkeypatch.setattr(_head_scores, "PATTERN_BUDGET", 1)  # one sequence per forward
    batched = tl_geometry.head_scores(model, windows=windows, seed=2)
    cols = ["previous_token", "duplicate_token", "induction", "sink_rate", "retrieval"]
    np.testing.assert_allclose(batched[cols].to_numpy(), whole[cols].to_numpy(), rtol=0, atol=1e-12)


def _windows(with_bos: bool, n: int = 2, length: int = 16) -> torch.Tensor:
    return tl_geometry.text_windows(tiny(with_bos), n_seqs=n, seq_len=length)


def test_windows_that_do_not_start_as_the_model_was_trained_are_refused():
    with pytest.raises(ValueError, match=r"do not start with BOS \(id 0\).*put BOS first"):
        tl_geometry.head_scores(tiny(True), windows=_windows(False))
    with pytest.raises(ValueError, match=r"start with the tokenizer's BOS.*trained without BOS.*tokens\[:, 1:\]"):
        tl_geometry.head_scores(tiny(False), windows=_windows(True))
    body = torch.randint(3, 40, (1, 4))
    with_bos = torch.cat([torch.full((1, 1), BOS), body[:, 1:]], 1)  # both halves start with BOS
    with pytest.raises(ValueError, match=r"repeated: .*start with the tokenizer's BOS"):
        tl_geometry.head_scores(tiny(False), repeated=torch.cat([with_bos, with_bos], 1),
                                windows=_windows(False))
    with pytest.raises(ValueError, match=r"\[batch, 2R\].*no BOS"):  # BOS + 2R for a model without
        tl_geometry.head_scores(tiny(False), repeated=torch.cat([torch.full((1, 1), BOS), body, body], 1),
                                windows=_windows(False))


def test_windows_holding_pad_tokens_are_refused():
    """A dedicated pad id (Gemma-3's <pad>) anywhere; a pad id that doubles as EOS (SmolLM2's
    <|im_end|>) only in a run: alone it is a document separator."""
    padded = _windows(True)
    padded[0, -3:] = PAD
    with pytest.raises(ValueError, match=r"sequence\(s\) \[0\] hold the pad token \(id 2\)"):
        tl_geometry.head_scores(tiny(True), windows=padded)
    one = _windows(True)
    one[1, 5] = PAD
    with pytest.raises(ValueError, match="pad token"):
        tl_geometry.head_scores(tiny(True), windows=one)
    shared = tiny(True, pad=EOS)
    separator = _windows(True)
    separator[1, 5] = EOS
    tl_geometry.head_scores(shared, windows=separator)  # one EOS inside the text: accepted
    separator[0, -2:] = EOS
    with pytest.raises(ValueError, match=r"\[0\] hold runs of the pad token \(id 1"):
        tl_geometry.head_scores(shared, windows=separator)
    left = _windows(False)
    left[:, :3] = PAD  # left padding on a model without BOS
    with pytest.raises(ValueError, match="no attention mask"):
        tl_geometry.head_scores(tiny(False), windows=left)


@pytest.mark.real_model
def test_real_tokenizers_pad_ids_and_refusals(real):
    """SmolLM2 pads with its EOS (id 2), Gemma-3 with a dedicated <pad> (id 0): a right-padded
    window is refused on both, and a window without BOS too."""
    tokenizer = real.model.tokenizer
    pad, bos, eos = tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id
    assert (pad == eos) is (real.name == "smollm2-135m") and pad != bos
    windows = tl_geometry.text_windows(real.model, n_seqs=1, seq_len=32)
    padded = windows.clone()
    padded[0, -4:] = pad
    with pytest.raises(ValueError, match="pad token"):
        tl_geometry.head_scores(real.model, windows=padded)
    with pytest.raises(ValueError, match="do not start with BOS"):
        tl_geometry.head_scores(real.model, windows=windows[:, 1:])


@pytest.mark.parametrize("repeated, message", [
    (torch.ones(1, 11), r"integer token ids, got dtype torch.float32"),
    (1.5, r"must be \[batch, 1 \+ 2R\].*got float"),
    (torch.zeros(0, 11, dtype=torch.long), "holds no sequences"),
], ids=["float-tensor", "float", "no-sequences"])
def test_bad_repeated_is_a_named_error(repeated, message):
    with pytest.raises(ValueError, match=message):
        tl_geometry.head_scores(tiny(True), repeated=repeated, windows=_windows(True))


@pytest.mark.parametrize("windows, message", [
    (torch.zeros(0, 16, dtype=torch.long), "windows holds no sequences"),
    (torch.zeros(2, 0, dtype=torch.long), r"T ≥ 4.*got \[2, 0\]"),
    (torch.zeros(2, 16), "integer token ids"),
], ids=["no-sequences", "no-positions", "float"])
def test_bad_windows_are_a_named_error(windows, message):
    with pytest.raises(ValueError, match=message):
        tl_geometry.head_scores(tiny(True), windows=windows)


@pytest.mark.parametrize("seed", ["a", 1.5, 2**70, -1, True])
def test_a_bad_seed_is_a_named_error(seed):
    with pytest.raises(ValueError, match=r"seed must be .*\[0, 2\*\*63\)"):
        tl_geometry.head_scores(tiny(True), seed=seed)


def test_no_model_is_a_named_error():
    with pytest.raises(ValueError, match=r"needs a TransformerLens model.*got None"):
        tl_geometry.head_scores(None)


# --- 3. the command line: refused before any load ---------------------------------------------------


def _refused(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert info.value.code == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith(f"tl-geometry {argv[0]}: error: ") and "Traceback" not in err
    return lines[0]


@pytest.mark.parametrize("value, phrase", [
    ("100000000000000000000000", "must be in [0, 2**63 - 1]"),
    ("-1", "must be in [0, 2**63 - 1]"),
    ("a", "expected a whole number ≥ 0, got 'a'"),
])
def test_scores_seed_out_of_range_is_refused_before_the_load(capsys, no_model_load, value, phrase):
    assert phrase in _refused(capsys, ["scores", f"--seed={value}"])


def test_scores_n_seqs_beyond_the_text_is_refused_before_the_load(capsys, no_model_load, tmp_path):
    line = _refused(capsys, ["scores", "--n-seqs", "100000"])
    assert "--n-seqs 100000: the built-in sample text has" in line and "fewer --n-seqs" in line
    text = tmp_path / "t.txt"
    text.write_text("word " * 200)
    assert "too short" in _refused(capsys, ["scores", "--text", str(text), "--n-seqs", "100"])
    assert "--n-seqs" in _refused(capsys, ["analyze", "--n-seqs", "100000"])


def test_a_model_without_bos_needs_seq_len_text_tokens_per_window(capsys, no_model_load, tmp_path):
    """--seq-len 10 makes 9 text tokens after BOS, or 10 without it: 18 bytes are enough for
    two windows only with BOS."""
    text = tmp_path / "t.txt"
    text.write_text("a" * 18)
    argv = ["analyze", "--text", str(text), "--n-seqs", "2", "--seq-len", "10"]
    line = _refused(capsys, [*argv, "--model", str(write_gguf(tmp_path / "q.gguf", False))])
    assert "too short" in line and "10 text tokens, no BOS" in line
    with pytest.raises(AssertionError, match="a model was loaded"):  # passes every check
        cli.main([*argv, "--model", str(write_gguf(tmp_path / "s.gguf", True))])


@pytest.mark.parametrize("argv, phrase", [
    (["analyze", "--labels", ""], "--labels is empty: give a path, e.g. --labels labels.csv"),
    (["analyze", "--csv", ""], "--csv is empty"),
    (["analyze", "--save", " "], "--save is empty"),
    (["scores", "--csv", ""], "--csv is empty"),
    (["report", "--out", ""], "--out is empty"),
    (["capacity", "--out", ""], "--out is empty"),
    (["analyze", "--text", ""], "--text is empty"),
    (["analyze", "--labels", "/"], "must end in .csv or .json"),
])
def test_an_empty_path_is_named_as_empty(capsys, no_model_load, argv, phrase):
    line = _refused(capsys, argv)
    assert phrase in line and "empty name" not in line


def test_outputs_naming_one_file_are_refused_before_the_load(capsys, no_model_load, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "sub").mkdir()
    line = _refused(capsys, ["analyze", "--labels", "same.csv", "--csv", "same.csv"])
    assert "--csv and --labels name the same file: one would overwrite the other" in line
    line = _refused(capsys, ["analyze", "--save", "run.pt", "--csv", "sub/../run.pt"])
    assert "--save and --csv name the same file (run.pt and sub/../run.pt)" in line
    os.symlink(tmp_path / "real.csv", tmp_path / "link.csv")
    assert "same file" in _refused(capsys, ["analyze", "--csv", "real.csv", "--labels", str(tmp_path / "link.csv")])
    text = tmp_path / "corpus.txt"
    text.write_text("plenty of text here. " * 400)
    for argv in (["analyze", "--text", "corpus.txt", "--csv", str(text)],
                 ["scores", "--text", "corpus.txt", "--csv", "./corpus.txt"]):
        assert "is the --text file the command reads" in _refused(capsys, argv)
    assert not any(path.exists() for path in [*tmp_path.glob("*.csv"), *tmp_path.glob("*.pt")])


def test_distinct_outputs_still_run(monkeypatch, tmp_path, capsys):
    from test_cli import _tiny_with_tokenizer

    monkeypatch.setattr("tl_geometry.inputs.models.load_model", lambda name, **_: _tiny_with_tokenizer())
    argv = ["analyze", "--n-seqs", "2", "--seq-len", "10", "--n-values", "2,3", "--no-progress",
            "--csv", str(tmp_path / "a.csv"), "--labels", str(tmp_path / "a.json"),
            "--save", str(tmp_path / "a.pt")]
    assert cli.main(argv) == 0
    assert all((tmp_path / name).stat().st_size > 0 for name in ("a.csv", "a.json", "a.pt"))


# --- dev.sh setup: its arguments, checked before anything is installed ---------------------------
@pytest.fixture
def dev_sh(tmp_path) -> Path:
    """A copy of scripts/dev.sh in an empty root: no .venv there and PYTHON=false, so whatever
    passes the argument checks fails at once instead of installing anything."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "dev.sh", tmp_path / "scripts" / "dev.sh")
    return tmp_path / "scripts" / "dev.sh"


@pytest.mark.parametrize("argv, phrase", [
    (["--models", "bogus"], "--models 'bogus' is not an opt-in model set"),
    (["--models=bogus"], "--models 'bogus'"),
    (["--models", "qwen", "extra"], "unexpected argument(s) after --models qwen: extra"),
    (["--models"], "--models needs a value"),
    (["extra"], "unknown argument 'extra'"),
])
def test_dev_sh_setup_names_a_bad_argument_and_exits_2(dev_sh, argv, phrase):
    env = {**os.environ, "PYTHON": "false"}
    proc = subprocess.run(["bash", str(dev_sh), "setup", *argv], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 2 and phrase in proc.stderr, proc.stderr
    assert "usage: bash scripts/dev.sh setup [--models qwen]" in proc.stderr
    assert not (dev_sh.parents[1] / ".venv").exists()


def test_dev_sh_setup_accepts_its_documented_arguments(dev_sh):
    """They pass the checks and reach the install, which fails here at once (PYTHON=false)."""
    subprocess.run(["bash", "-n", str(dev_sh)], check=True, timeout=60)
    env = {**os.environ, "PYTHON": "false"}
    for argv in ([], ["--models", "qwen"], ["--models=qwen"]):
        proc = subprocess.run(["bash", str(dev_sh), "setup", *argv], capture_output=True, text=True,
                              env=env, timeout=60)
        assert proc.returncode not in (0, 2) and "usage" not in proc.stderr, (argv, proc.stderr)


# --- scores --seq-len and --repeat ----------------------------------------------------------------
@pytest.mark.parametrize("argv, phrase", [
    (["--repeat", "1"], "argument --repeat: must be ≥ 2 (with R = 1 the induction key is the query itself), got 1"),
    (["--repeat", "0"], "argument --repeat: must be ≥ 1, got 0"),
    (["--repeat", "x"], "argument --repeat: expected a whole number ≥ 1, got 'x'"),
    (["--repeat=-3"], "argument --repeat: must be ≥ 1, got -3"),
    (["--repeat", "5000"], "--repeat 5000 makes sequences of up to 10001 tokens (BOS + 2R), beyond "
                           "smollm2-135m's context length of 8192; use --repeat 4095 or less"),
    (["--seq-len", "3"], "--seq-len 3 is too short"),
    (["--seq-len", "9000"], "--seq-len 9000 is longer than smollm2-135m's context length of 8192"),
    (["--seq-len", "8160"], "--seq-len 8160 makes retrieval sequences of 8160 + 48 tokens (the needle and "
                            "its repeat), beyond smollm2-135m's context length of 8192; use --seq-len 8144 or less"),
], ids=["repeat-1", "repeat-0", "repeat-word", "repeat-negative", "repeat-beyond-context",
        "seq-len-3", "seq-len-beyond-context", "seq-len-retrieval-beyond-context"])
def test_scores_bad_repeat_and_seq_len_are_refused_before_the_load(capsys, no_model_load, argv, phrase):
    assert phrase in _refused(capsys, ["scores", "--model", "smollm2-135m", *argv])


def test_scores_repeat_beyond_a_sliding_window_is_one_line_after_the_load(monkeypatch, capsys):
    """The window is known only once the model is loaded: then one line and exit 2."""
    def load(name, **_):
        model = tiny(True)
        model.cfg.attn_types, model.cfg.window_size = ["local", "global", "local"], 8
        return model

    monkeypatch.setattr(models, "load_model", load)
    seen = spy_head_score_inputs(monkeypatch)
    with pytest.raises(SystemExit) as info:
        cli.main(["scores", "--repeat", "8", "--seq-len", "16", "--no-progress"])
    out, err = capsys.readouterr()
    loading, line = err.strip().splitlines()
    assert info.value.code == 2 and out == "" and loading.startswith("Loading") and not seen
    assert line == ("tl-geometry scores: error: --repeat 8: smollm2-135m's sliding-window layers see "
                    "the last 8 keys, and a query of the second copy sees its token's earlier "
                    "occurrence only for R ≤ w − 1 = 7; use --repeat 7 or less.")
    assert cli.main(["scores", "--repeat", "7", "--seq-len", "16", "--no-progress"]) == 0


def test_scores_seq_len_and_repeat_reach_the_table(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(models, "load_model", lambda name, **_: tiny(True))
    seen = spy_head_score_inputs(monkeypatch)
    csv = tmp_path / "s.csv"
    assert cli.main(["scores", "--seq-len", "24", "--repeat", "5", "--n-seqs", "3", "--no-progress",
                     "--csv", str(csv)]) == 0
    repeated, windows, sink, needled = seen  # --seq-len < 64: Sink^ε reads 64-token windows apart
    assert repeated.shape == (8, 11) and windows.shape == (3, 24) and sink.shape == (3, 64)
    assert needled.shape == (3, 24 + 48) and torch.equal(sink[0, :24], windows[0])
    out = capsys.readouterr().out
    assert "3 windows of 24 tokens; R = 5" in out and "on 64-token windows):" in out
    table = __import__("pandas").read_csv(csv)
    assert (table["sink_queries"] == 23).all() and len(table) == 12
    seen.clear()
    assert cli.main(["scores", "--n-seqs", "2", "--no-progress"]) == 0  # the defaults: 128 and 32
    assert [tuple(t.shape) for t in seen] == [(8, 65), (2, 128), (2, 64), (2, 128 + 48)]
    assert "2 windows of 128 tokens; R = 32" in capsys.readouterr().out


def test_prune_reads_bos_for_its_doubled_windows(capsys, no_model_load, tmp_path):
    """prune checks the text for twice --n-seqs windows with the same --bos as every command: 36
    bytes make four windows of 9 text tokens after BOS, not four of 10 without it."""
    text = tmp_path / "t.txt"
    text.write_text("a" * 36)
    argv = ["prune", "--text", str(text), "--n-seqs", "2", "--seq-len", "10", "--out", str(tmp_path / "out"),
            "--model", str(write_gguf(tmp_path / "s.gguf", True))]
    line = _refused(capsys, [*argv, "--bos", "no"])
    assert "too short" in line and "10 text tokens, no BOS" in line
    with pytest.raises(AssertionError, match="a model was loaded"):  # passes every check
        cli.main(argv)


def test_head_scores_checks_attention_before_any_forward():
    """An unknown source, and 'recompute' on a model with no Hugging Face module, are refused
    with the fix (TinyLM has hooks only: 'auto' takes the pattern)."""
    model = tiny(True)
    with pytest.raises(ValueError, match=r"attention must be one of 'auto', 'pattern', 'recompute', got 'sdpa'"):
        tl_geometry.head_scores(model, seq_len=16, repeat=4, attention="sdpa")
    with pytest.raises(ValueError, match="use attention='pattern' for this model"):
        tl_geometry.head_scores(model, seq_len=16, repeat=4, attention="recompute")
    assert tl_geometry.head_scores(model, seq_len=16, repeat=4).attrs["attention"] == "pattern"
