"""Model files without a real model: GGUF headers, split-file assembly, the weight cache, the
refusals of files that cannot load (ModelLoadError), and the command line's one line for them."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from repo_paths import REPO

from tl_geometry.inputs import model_files, models, weight_cache
from tl_geometry.inputs.gguf_header import GGUFHeaderError, read_gguf_info
from tl_geometry.inputs.model_files import (
    ModelLoadError,
    ModelNotInstalledError,
    SplitGGUF,
    assemble,
)

ROOT = REPO


@pytest.fixture(autouse=True)
def tmp_cache(own_cache: Path) -> Path:
    """Every test here writes into its own user cache."""
    return own_cache


def write_gguf(path: Path, context_length: int = 64, add_bos: bool | None = None) -> Path:
    """A small but valid GGUF file: llama metadata and two tensors (no tokenizer); with
    ``add_bos``, the header says whether the model was trained with BOS (a load needs that)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(context_length)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    writer.add_tensor("token_embd.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    writer.add_tensor("output.weight", np.ones((8, 4), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def smollm2_gguf() -> Path:
    try:
        return models.gguf_path("smollm2-135m")
    except ModelNotInstalledError as err:
        pytest.skip(f"SmolLM2's weights are not installed: {err}")


# --- GGUF headers ---------------------------------------------------------------------------------
def test_gguf_header_reads_context_length_and_data_end(tmp_path):
    path = write_gguf(tmp_path / "m.gguf", context_length=77)
    info = read_gguf_info(path)
    assert (info.architecture, info.context_length, info.n_tensors) == ("llama", 77, 2)
    assert info.data_end == path.stat().st_size
    assert models.context_length(path) == 77


@pytest.mark.parametrize("keep", [0, 3, 4, 24, 100, -1])
def test_gguf_cut_short_is_refused_with_where_it_breaks(tmp_path, keep):
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[:keep])
    with pytest.raises(GGUFHeaderError, match=r"byte|GGUF"):
        read_gguf_info(cut)


@pytest.mark.parametrize("size", [4, 100, 1_000_000])
def test_load_model_refuses_a_truncated_gguf_naming_the_file_and_the_fix(tmp_path, size):
    """issue 27: the GGUF magic, then nothing whole (a raw struct.error before)."""
    cut = tmp_path / "x.gguf"
    with smollm2_gguf().open("rb") as handle:
        cut.write_bytes(handle.read(size))
    for call in (models.model_source, models.load_model, models.load_hf_model):
        with pytest.raises(ModelLoadError, match=rf"{cut}.*not a whole GGUF file.*again") as info:
            call(cut)
        assert isinstance(info.value, ValueError)
    assert models.context_length(cut) is None  # no number from a broken file; model_source says why


def test_gguf_whose_tensor_data_is_cut_short_is_refused(tmp_path):
    path = write_gguf(tmp_path / "m.gguf")
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ModelLoadError, match=r"truncated: its tensors end at byte 416"):
        models.model_source(path)


# --- the user's folder: safetensors checked before transformers reads them -------------------------
def hf_folder(path: Path, weights: bytes, config: str = "{}") -> Path:
    path.mkdir()
    (path / "config.json").write_text(config)
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(weights)
    return path


def valid_safetensors() -> bytes:
    from safetensors.torch import save

    return save({"w": torch.zeros(4, 4)})


@pytest.mark.parametrize("weights, message", [
    (b"0123456789", r"not a whole safetensors file: its header cannot be read \(safetensors: .*too large"),
    (b"\x00" * 5, "only 5 byte"),
    (b"\x02\x00\x00\x00\x00\x00\x00\x00{]", "header cannot be read"),
    ("truncated", "it is truncated"),
    ("no-data", "it is truncated"),  # the header whole, every tensor's data missing
    ("extra", "bytes after its last tensor"),
])
def test_damaged_safetensors_is_refused_before_the_load(tmp_path, weights, message):
    """safetensors.safe_open reads the header and checks that the data offsets cover the file."""
    whole = valid_safetensors()
    header_end = 8 + int.from_bytes(whole[:8], "little")
    weights = {"truncated": whole[:-10], "no-data": whole[:header_end],
               "extra": whole + b"\0" * 4}.get(weights, weights)
    folder = hf_folder(tmp_path / "m", weights)
    with pytest.raises(ModelLoadError, match=rf"Weights file {folder / 'model.safetensors'} .*{message}"):
        models.load_model(folder)
    assert models._safetensors_problem(folder / "model.safetensors") is not None
    (folder / "model.safetensors").write_bytes(whole)
    assert models._safetensors_problem(folder / "model.safetensors") is None


def test_what_transformers_still_refuses_is_a_model_load_error(tmp_path):
    """A whole safetensors file with a config transformers cannot use: one clear error."""
    folder = hf_folder(tmp_path / "m", valid_safetensors())
    with pytest.raises(ModelLoadError, match=r"transformers could not load a causal language model from"):
        models.load_hf_model(folder, bos=True)  # the folder does not say it: stated, to reach transformers


def test_unreadable_config_is_refused(tmp_path):
    folder = hf_folder(tmp_path / "m", valid_safetensors(), config="{not json")
    with pytest.raises(ModelLoadError, match=r"config\.json cannot be read"):
        models.model_source(folder)


@pytest.mark.parametrize("name", [None, 5, 2.5, ["smollm2-135m"]])
def test_a_model_that_is_not_a_name_or_path_says_what_is_accepted(name):
    with pytest.raises(TypeError, match=r"str or os.PathLike.*smollm2-135m.*\.gguf file"):
        models.load_model(name)


def test_an_empty_model_name_is_refused():
    with pytest.raises(ModelLoadError, match="empty"):
        models.model_source("  ")


# --- hub ids: only from the user's Hugging Face cache, never downloaded ------------------------------
@pytest.mark.parametrize("key, revision", [("owner/missing", "main"), ("owner/name@v9", "v9")])
def test_a_hub_id_not_in_the_hf_cache_names_the_download_and_the_folder(tmp_path, monkeypatch, key,
                                                                        revision):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    storage = tmp_path / "hf" / "hub" / "models--owner--name"  # a repo whose v9 is not cached
    (storage / "snapshots" / ("a" * 40)).mkdir(parents=True)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text("a" * 40)
    repo = key.split("@")[0]
    download = f"hf download {repo}" + ("" if revision == "main" else f" --revision {revision}")
    for call in (models.model_source, models.load_model):
        with pytest.raises(ModelLoadError, match=(
                rf"Unknown model '{key}'.*has no snapshot \(revision '{revision}'\) in the Hugging Face "
                rf"cache {tmp_path / 'hf' / 'hub'}.*Nothing is downloaded.*`{download}`.*local folder")):
            call(key)
    assert models.context_length(key) is None
    # Not shaped like a hub id: the plain "no such file or folder".
    for other in ("gpt2", "models/missing.gguf", "./owner/missing"):
        with pytest.raises(ModelLoadError, match="no such file or folder"):
            models.model_source(other)


# --- context length before the load ---------------------------------------------------------------
def test_context_length_of_builtins_and_folders(tmp_path):
    assert models.context_length("smollm2-135m") == 8192
    assert models.context_length("qwen2.5-coder-0.5b") == 32768
    folder = hf_folder(tmp_path / "m", valid_safetensors(), config='{"max_position_embeddings": 32}')
    assert models.context_length(folder) == 32
    nested = hf_folder(tmp_path / "n", valid_safetensors(), config='{"text_config": {"n_positions": 48}}')
    assert models.context_length(nested) == 48
    assert models.context_length(hf_folder(tmp_path / "o", valid_safetensors())) is None


def test_builtin_context_lengths_match_their_gguf_files():
    assert read_gguf_info(smollm2_gguf()).context_length == models.MODELS["smollm2-135m"].n_ctx


# --- split GGUF files: assembly ---------------------------------------------------------------------
def parts(tmp_path: Path, data: bytes, n: int = 3) -> list[Path]:
    step = -(-len(data) // n)
    paths = []
    for i in range(n):
        path = tmp_path / f"part{i + 1:02d}.bin"
        path.write_bytes(data[i * step:(i + 1) * step])
        paths.append(path)
    return paths


def test_assemble_checks_size_and_sha256_and_writes_once(tmp_path):
    import hashlib

    data = os.urandom(10_000)
    target = tmp_path / "out" / "m.gguf"
    kwargs = dict(size=len(data), sha256=hashlib.sha256(data).hexdigest(), fix="reinstall X")
    assert assemble(parts(tmp_path, data), target, **kwargs) == target
    assert target.read_bytes() == data
    mtime = target.stat().st_mtime_ns
    assemble(lambda: pytest.fail("a whole file is not assembled again"), target, **kwargs)
    assert target.stat().st_mtime_ns == mtime
    target.write_bytes(data[:5000])  # a partial earlier file is rebuilt
    assemble(parts(tmp_path, data), target, **kwargs)
    assert target.read_bytes() == data
    assert [p.name for p in target.parent.iterdir()] == ["m.gguf"]  # no temporary file left


def test_assemble_refuses_damaged_or_partial_parts_and_leaves_nothing(tmp_path):
    import hashlib

    data = os.urandom(10_000)
    target = tmp_path / "out" / "m.gguf"
    sha = hashlib.sha256(data).hexdigest()
    flipped = bytearray(data)
    flipped[1234] ^= 1
    with pytest.raises(ModelLoadError, match=r"not the recorded .*corrupted.*reinstall X"):
        assemble(parts(tmp_path, bytes(flipped)), target, size=len(data), sha256=sha, fix="reinstall X")
    with pytest.raises(ModelLoadError, match=r"add up to 9,999 bytes.*10,000.*partial.*reinstall X"):
        assemble(parts(tmp_path, data[:-1]), target, size=len(data), sha256=sha, fix="reinstall X")
    missing = parts(tmp_path, data)
    missing[1].unlink()
    with pytest.raises(ModelNotInstalledError, match="missing"):
        assemble(missing, target, size=len(data), sha256=sha, fix="reinstall X")
    assert not target.exists() and list(target.parent.glob("*")) == []


def test_split_parts_not_installed_name_the_setup_command():
    split = SplitGGUF(prefix="no-such-weights-part", n_parts=2, version="1.0", size=1, sha256="0" * 64)
    with pytest.raises(ModelNotInstalledError, match=r"bash scripts/dev.sh setup --models qwen.*"
                                                     r"no-such-weights-part1==1.0 no-such-weights-part2==1.0"):
        split.part_paths()
    assert "--force-reinstall" in split.reinstall


def test_qwen_specs_are_pinned_with_full_digests():
    for name, parts_, version, size in (("qwen2.5-coder-0.5b", 6, "0.9.0", 491_400_064),
                                        ("qwen2.5-coder-1.5b", 22, "0.2.0", 1_117_320_768)):
        split = models.MODELS[name].split
        assert split is not None
        assert (split.n_parts, split.version, split.size) == (parts_, version, size)
        assert len(split.sha256) == 64 and int(split.sha256, 16) >= 0
    assert models.MODELS["qwen2.5-coder-0.5b"].split.sha256.startswith("1d9614638d18")


def test_file_sha256_is_remembered_until_the_file_changes(tmp_path, monkeypatch):
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    first = model_files.file_sha256(path)
    monkeypatch.setattr(model_files, "_hash_stream", lambda *a: pytest.fail("hashed again"))
    assert model_files.file_sha256(path) == first
    monkeypatch.undo()
    path.write_bytes(b"abd")
    assert model_files.file_sha256(path) != first


# --- the weight cache ---------------------------------------------------------------------------
def tiny_model_and_tokenizer():
    """A 2-layer Llama and a word-level tokenizer, the same on every call (seeded)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    vocab = {f"t{i}": i for i in range(31)} | {"<unk>": 31}
    words = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>")
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A GGUF source whose de-quantisation is the tiny model; counts the de-quantisations."""
    path = write_gguf(tmp_path / "fake.gguf", add_bos=True)
    source = models._Source("fake", path.parent, path.name, None)
    real = models._from_pretrained
    calls: list[str] = []

    def from_pretrained(src, dtype, device_map=None):
        if src.gguf_file is not None:
            calls.append(src.gguf_file)
            return tiny_model_and_tokenizer()
        return real(src, dtype, device_map)

    monkeypatch.setattr(models, "_from_pretrained", from_pretrained)
    return source, calls


def logits_of(model) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.arange(12).reshape(2, 6)).logits


def test_weight_cache_fills_once_then_loads_the_same_weights(fake_gguf, tmp_cache):
    source, calls = fake_gguf
    want = logits_of(tiny_model_and_tokenizer()[0])
    first = models._load_hf(source, torch.float32)
    second = models._load_hf(source, torch.float32)
    assert calls == ["fake.gguf"]  # de-quantised once
    assert first.cache_entry == second.cache_entry and first.cache_entry.parent == tmp_cache / "weights"
    torch.testing.assert_close(logits_of(second.model), logits_of(first.model), rtol=0, atol=0)
    for loaded in (first, second):  # the reference runs sdpa, the loads eager attention
        torch.testing.assert_close(logits_of(loaded.model), want, rtol=1e-5, atol=1e-6)
        assert loaded.tokenizer("t3 t5")["input_ids"] == [3, 5]
        assert getattr(loaded.model, "hf_quantizer", None) is None
    manifest = json.loads((first.cache_entry / "manifest.json").read_text())
    assert manifest["source"]["size"] == (source.folder / source.gguf_file).stat().st_size
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(manifest["files"])
    models._load_hf(source, torch.bfloat16)  # another dtype: its own entry
    assert len(calls) == 2 and len(list((tmp_cache / "weights").iterdir())) == 2


@pytest.mark.parametrize("damage, problem", [
    ("flip", "does not match its recorded sha256"),
    ("truncate", r"model\.safetensors: [\d,]+ bytes, not [\d,]+"),
    ("manifest", "no readable manifest"),
    ("missing", "missing"),
])
def test_a_damaged_entry_is_detected_and_rebuilt_never_used(fake_gguf, damage, problem):
    source, calls = fake_gguf
    entry = models._load_hf(source, torch.float32).cache_entry
    weights = entry / "model.safetensors"
    data = bytearray(weights.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x40
        weights.write_bytes(bytes(data))
    elif damage == "truncate":
        weights.write_bytes(bytes(data[: len(data) // 2]))
    elif damage == "manifest":
        (entry / "manifest.json").write_text('{"files": ')
    else:
        (entry / "tokenizer.json").unlink()
    with pytest.warns(UserWarning, match=problem):
        again = models._load_hf(source, torch.float32)
    assert calls == ["fake.gguf"] * 2
    torch.testing.assert_close(logits_of(again.model), logits_of(tiny_model_and_tokenizer()[0]),
                               rtol=1e-5, atol=1e-6)
    assert weight_cache.lookup(weight_cache.entry_key(source.folder / source.gguf_file, "float32")) == entry


@pytest.mark.parametrize("how", ["option", "env"])
def test_the_weight_cache_can_be_turned_off(fake_gguf, tmp_cache, monkeypatch, how):
    source, _ = fake_gguf
    if how == "env":
        monkeypatch.setenv(weight_cache.ENV, "0")
    loaded = models._load_hf(source, torch.float32, use_cache=False if how == "option" else None)
    assert loaded.cache_entry is None and not (tmp_cache / "weights").exists()
    assert weight_cache.enabled(True) and not weight_cache.enabled(False)


def test_an_unwritable_cache_warns_and_loads_anyway(fake_gguf, tmp_cache, capsys):
    source, calls = fake_gguf
    tmp_cache.mkdir(parents=True)
    (tmp_cache / "weights").write_text("a file where the folder should be")
    with pytest.warns(UserWarning, match="could not be written"):
        loaded = models._load_hf(source, torch.float32)
    assert loaded.cache_entry is None and calls == ["fake.gguf"]
    assert capsys.readouterr().err.splitlines()[-1].endswith("the weight cache could not be written")


def test_the_one_time_dequantisation_says_so_on_stderr(fake_gguf, capsys):
    """No bar is drawn (nor any under --no-progress), so one line says it started, with a rough
    time for the file's size, and one says it ended, with the time taken; a cached load says nothing."""
    import re

    source, calls = fake_gguf
    models._load_hf(source, torch.float32)
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("de-quantising fake into the weight cache (once per model; about 5 s for this "
                      "size) ...")
    assert re.fullmatch(r"de-quantised fake in \d+\.\d s; later loads read the weight cache", err[1])
    assert len(err) == 2
    models._load_hf(source, torch.float32)
    assert calls == ["fake.gguf"] and "de-quantis" not in capsys.readouterr().err
    assert models._dequantise_guess(models.MODELS["smollm2-135m"].files.size) < models._dequantise_guess(
        models.MODELS["gemma3-270m"].files.size) < models._dequantise_guess(10**9)


def test_a_failed_dequantisation_ends_its_line(fake_gguf, monkeypatch, capsys):
    source, _ = fake_gguf

    def fail(src, dtype, device_map=None):
        raise ModelLoadError("transformers could not load a causal language model from x: broken")

    monkeypatch.setattr(models, "_from_pretrained", fail)
    with pytest.raises(ModelLoadError, match="broken"):
        models._load_hf(source, torch.float32)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[1].startswith("de-quantising fake stopped after ")


def test_a_second_filler_keeps_the_first_entry(tmp_cache):
    """Two fillers of one entry: the one that renames second finds a whole entry and keeps it."""
    key = weight_cache.EntryKey("ab" * 32, 3, "float32", "m.gguf")

    def write(content):
        def go(folder):
            (folder / "weights.bin").write_text(content)
            if content == "outer":  # the other process finishes while this one still writes
                weight_cache.store(key, write("inner"))
        return go

    entry = weight_cache.store(key, write("outer"))
    assert (entry / "weights.bin").read_text() == "inner"
    assert weight_cache.lookup(key) == entry
    assert [p.name for p in entry.parent.iterdir()] == [key.name]  # no temporary folder left


def test_concurrent_processes_fill_one_entry_without_damage(tmp_cache):
    script = textwrap.dedent("""
        import sys, time
        from pathlib import Path
        from tl_geometry.inputs import weight_cache
        key = weight_cache.EntryKey("cd" * 32, 7, "float32", "m.gguf")
        def write(folder):
            for i in range(20):
                (folder / f"shard{i}.bin").write_bytes(bytes([i]) * 50_000)
                time.sleep(0.005)
        entry = weight_cache.store(key, write)
        assert weight_cache.lookup(key) == entry
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TL_GEOMETRY_CACHE": str(tmp_cache)}
    procs = [subprocess.Popen([sys.executable, "-c", script], env=env) for _ in range(3)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0]
    key = weight_cache.EntryKey("cd" * 32, 7, "float32", "m.gguf")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a damaged entry would warn
        entry = weight_cache.lookup(key)
    assert entry is not None and len(list(entry.glob("shard*.bin"))) == 20
    assert [p.name for p in (tmp_cache / "weights").iterdir()] == [key.name]


# --- the command line: one line and exit 2 for every bad model path ----------------------------------
@pytest.fixture
def no_model_load(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded although the model path was bad")

    monkeypatch.setattr(models, "load_model", refuse)


def _one_line_exit_2(capsys, argv: list[str], *, loaded: bool = False) -> str:
    """The error line of a refused command; before a load it is all that is printed (after one,
    the "Loading ..." progress lines come first)."""
    from tl_geometry.cli.main import main

    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if " error: " in line]
    assert info.value.code == 2 and len(errors) == 1 and err[-1] == errors[0], err
    assert loaded or len(err) == 1, err
    return err[-1]


@pytest.mark.parametrize("command", ["capacity", "analyze", "report", "ablate", "prune"])
@pytest.mark.parametrize("bad", ["gguf-4", "gguf-100", "gguf-tail", "safetensors-10", "not-gguf"])
def test_cli_bad_model_paths_exit_2_with_one_line_before_the_load(tmp_path, capsys, no_model_load,
                                                                  command, bad):
    path = tmp_path / "x.gguf"
    whole = write_gguf(tmp_path / "whole.gguf").read_bytes()
    if bad == "gguf-4":
        path.write_bytes(whole[:4])
    elif bad == "gguf-100":
        path.write_bytes(whole[:100])
    elif bad == "gguf-tail":
        path.write_bytes(whole[:-8])
    elif bad == "not-gguf":
        path.write_bytes(b"PK\x03\x04")
    else:
        path = hf_folder(tmp_path / "m", b"0123456789")
    argv = [command, "--model", str(path)]
    if command == "ablate":
        argv += ["--heads", "0.0"]
    line = _one_line_exit_2(capsys, argv)
    assert f"tl-geometry {command}: error: --model: " in line and str(path) in line


def test_cli_refuses_a_seq_len_beyond_the_context_before_the_load(tmp_path, capsys, no_model_load):
    line = _one_line_exit_2(capsys, ["analyze", "--seq-len", "9000"])
    assert "--seq-len 9000 is longer than smollm2-135m's context length of 8192" in line
    gguf = write_gguf(tmp_path / "m.gguf", context_length=64)
    assert "context length of 64 tokens; use --seq-len 64 or less" in _one_line_exit_2(
        capsys, ["capacity", "--model", str(gguf), "--seq-len", "65"])
    folder = hf_folder(tmp_path / "f", valid_safetensors(), config='{"max_position_embeddings": 32}')
    assert "context length of 32" in _one_line_exit_2(capsys, ["report", "--model", str(folder),
                                                               "--seq-len", "40"])


def test_cli_checks_the_context_after_the_load_when_the_files_do_not_say(monkeypatch, capsys):
    from types import SimpleNamespace

    model = SimpleNamespace(cfg=SimpleNamespace(n_ctx=16))
    monkeypatch.setattr(models, "load_model", lambda name, **_: model)
    monkeypatch.setattr(models, "context_length", lambda name: None)
    assert "context length of 16" in _one_line_exit_2(capsys, ["analyze", "--seq-len", "20"], loaded=True)


def test_cli_maps_a_load_error_after_the_checks_to_one_line(monkeypatch, capsys):
    def fail(name, **_):
        raise ModelLoadError("transformers could not load a causal language model from /m: broken")

    monkeypatch.setattr(models, "load_model", fail)
    line = _one_line_exit_2(capsys, ["analyze", "--seq-len", "16"], loaded=True)
    assert line == ("tl-geometry analyze: error: --model: transformers could not load a causal "
                    "language model from /m: broken")


def test_device_and_device_map_are_exclusive():
    with pytest.raises(ValueError, match=r"device= .* or device_map=.*not both"):
        models.load_model("smollm2-135m", device="cpu", device_map="auto")


def test_temporary_folders_of_dead_fillers_are_swept_later(tmp_cache):
    root = tmp_cache / "weights"
    name = weight_cache.EntryKey("ab" * 32, 1, "float32").name  # the names store() gives them
    old, fresh = root / f".{name}.dead1234.tmp", root / f".{name}.busy1234.tmp"
    for folder in (old, fresh):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"partial")
    os.utime(old, (0, 0))
    weight_cache.store(weight_cache.EntryKey("ef" * 32, 1, "float32"), lambda f: (f / "w").write_text("x"))
    assert not old.exists() and fresh.exists()  # a live filler's folder is left alone
