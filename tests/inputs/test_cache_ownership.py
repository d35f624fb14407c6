"""What the user cache owns: ``clear`` deletes only what the cache wrote (its entries, digests,
assembled files and temporaries, each by its exact name), never follows a symbolic link, and
lists what it left alone; a cache path that is a file is one clear error; and a model loaded from
the weight cache no longer depends on the cache's files. Every test runs on its own cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from repo_paths import REPO, TESTS
from test_model_files import tiny_model_and_tokenizer, write_gguf

from tl_geometry.cli.main import main
from tl_geometry.inputs import model_files, models, weight_cache
from tl_geometry.inputs.model_files import CacheFolderError

ROOT = REPO


@pytest.fixture(autouse=True)
def cache(own_cache: Path) -> Path:
    """Every test here writes into its own user cache, never the user's."""
    return own_cache


def fill(key: weight_cache.EntryKey, weights: bytes = b"w" * 5000) -> Path:
    """An entry written by the cache itself."""
    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(weights)
        (folder / "config.json").write_text('{"model_type": "llama"}')

    return weight_cache.store(key, write)


def put(path: Path, text: str = "the user's own bytes") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def snapshot(folder: Path) -> dict[str, str]:
    """Every file, folder and link under ``folder`` (links not followed) with its bytes or target."""
    found = {}
    for top, folders, files in os.walk(folder):
        for name in (*folders, *files):
            path = Path(top) / name
            rel = path.relative_to(folder).as_posix()
            if path.is_symlink():
                found[rel] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                found[rel] = "folder"
            else:
                found[rel] = path.read_bytes().hex()
    return found


def state(path: Path) -> Any:
    """What a foreign item holds: a link's target, a folder's snapshot, a file's bytes."""
    if path.is_symlink():
        return os.readlink(path)
    return snapshot(path) if path.is_dir() else path.read_bytes()


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """``tl-geometry cache ...``: its exit status (``SystemExit``'s too), stdout and stderr."""
    try:
        status = main(["cache", *argv])
    except SystemExit as stop:
        status = int(stop.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


OLD = (0, 0)  # times of a temporary left by a process that died long ago


# --- clear deletes what the cache wrote, and nothing else -----------------------------------------
@pytest.fixture
def shared(cache, tmp_path) -> dict[str, Any]:
    """A cache folder shared with the user's files: entries and digests of the cache, and
    everything a user may put beside them (or link in)."""
    outside = tmp_path / "outside"
    precious = put(outside / "precious.bin", "outside the cache")
    put(outside / "precious_dir" / "keep.txt", "outside the cache too")
    linked_entry = outside / f"{'12' * 16}-7-float32"  # looks like an entry, with the marker
    put(linked_entry / weight_cache.MARKER, "")
    put(linked_entry / "model.safetensors", "a linked entry's weights")

    entry = fill(weight_cache.EntryKey("ab" * 32, 3, "float32", "a.gguf"))
    old_style = fill(weight_cache.EntryKey("cd" * 32, 4, "bfloat16", "b.gguf"))
    (old_style / weight_cache.MARKER).unlink(missing_ok=True)  # written before the marker: a manifest only
    os.symlink(precious, entry / "link-to-a-file")
    os.symlink(outside / "precious_dir", entry / "link-to-a-folder")
    model_files.file_sha256(precious)  # a remembered digest: sha256/<32 hex>.json
    weights, digests = cache / "weights", cache / "sha256"
    old_tmp = weights / f".{entry.name}.dead1234.tmp"  # the names store() and _discard() give
    stale = weights / f".{entry.name}.0123abcd.stale"
    for folder in (old_tmp, stale):
        put(folder / "model.safetensors", "partial")
        os.utime(folder, OLD)
    digest_tmp = put(digests / f".{'e' * 32}.json.k3j_x9q2.tmp", "{")
    os.utime(digest_tmp, OLD)

    dead = put(weights / ".dead.tmp" / "model.safetensors").parent  # a dot name the cache never gives
    os.utime(dead, OLD)
    foreign = [
        put(weights / "my-checkpoint" / "config.json", '{"model_type": "llama"}').parent,
        put(weights / "README.md"), put(weights / "notes.txt"),
        put(digests / "README.md"), put(digests / "notes.json", '{"mine": 1}'),
        put(weights / f"{'ef' * 16}-5-float32" / "model.safetensors").parent,  # an entry's name only
        put(weights / f"{'fe' * 16}-6-float32" / "manifest.json", '{"files": {}}').parent,  # not ours
        dead,
        put(weights / f".{entry.name}.x.tmp"),  # a temporary's name, but a file, not a folder
        weights / f"{'12' * 16}-7-float32",  # a link to an entry-like folder outside
        weights / f".{entry.name}.link1234.tmp",  # a link at a temporary's name
        digests / f"{'d' * 32}.json",  # a link at a digest's name
    ]
    put(weights / "my-checkpoint" / "model.safetensors", "my fine-tune")
    os.symlink(linked_entry, foreign[9])
    os.symlink(outside / "precious_dir", foreign[10])
    os.symlink(precious, foreign[11])
    at_root = [put(cache / "README.md"), put(cache / "notes.txt")]
    return {"outside": outside, "entry": entry, "old_style": old_style, "old_tmp": old_tmp,
            "stale": stale, "digest_tmp": digest_tmp, "foreign": foreign, "at_root": at_root}


def test_clear_deletes_only_what_the_cache_wrote(cache, shared):
    outside = snapshot(shared["outside"])
    kept = {path: state(path) for path in [*shared["foreign"], *shared["at_root"]]}
    before = weight_cache.usage()
    n_digests = len([p for p in (cache / "sha256").glob("*.json") if not p.is_symlink()]) - 1  # notes.json
    assert (before.entries.count, before.digests.count, before.temporary.count) == (2, n_digests, 3)
    assert n_digests >= 1 and sorted(before.foreign) == sorted(shared["foreign"])
    done = weight_cache.clear()
    assert not done.errors
    for name in ("entry", "old_style", "old_tmp", "stale", "digest_tmp"):
        assert not os.path.lexists(shared[name]), name
    assert (done.removed.entries.count, done.removed.digests.count, done.removed.temporary.count) == (
        2, n_digests, 3)
    assert sorted(p.name for p in (cache / "sha256").iterdir()) == sorted(
        ["README.md", "notes.json", f"{'d' * 32}.json"])
    for path, was in kept.items():  # every foreign item is still there, with its bytes
        assert os.path.lexists(path) and state(path) == was, path
    assert snapshot(shared["outside"]) == outside  # nothing outside the cache was touched
    assert sorted(done.foreign) == sorted(shared["foreign"])
    after = weight_cache.usage()
    assert after.total == 0 and sorted(after.foreign) == sorted(shared["foreign"])


def test_cache_clear_prints_what_it_left_alone_and_exits_0(cache, shared, capsys):
    status, out, err = run_cli(capsys, "clear")
    assert status == 0 and err == ""
    (line,) = [line for line in out.splitlines() if "did not write" in line]
    n = len(shared["foreign"])
    assert line.startswith(f"left alone: {n} item(s) the cache did not write: ") and line.endswith(
        f"(and {n - 5} more)")
    assert str(cache / "weights" / "README.md") in line  # sorted: the first five are named
    assert (cache / "weights" / "my-checkpoint" / "model.safetensors").read_text() == "my fine-tune"
    status, out, _ = run_cli(capsys, "info")
    assert status == 0 and f"not the cache's (left alone by clear): {n} item(s)" in out


@pytest.mark.parametrize("linked", ["weights", "sha256", "model"])
def test_a_linked_cache_folder_is_neither_entered_nor_deleted(cache, tmp_path, linked, capsys):
    model, file = next(iter(sorted(weight_cache.ASSEMBLED.items())))
    target = tmp_path / "elsewhere"
    if linked == "weights":
        put(target / f"{'ab' * 16}-3-float32" / weight_cache.MARKER, "")
        put(target / f".{'ab' * 16}-3-float32.dead1234.tmp" / "w", "partial")
        os.utime(target / f".{'ab' * 16}-3-float32.dead1234.tmp", OLD)
    elif linked == "sha256":
        put(target / f"{'a' * 32}.json", '{"stamp": "x", "sha256": "y"}')
    else:
        put(target / file, "a GGUF file of the user's")
    put(target / "README.md")
    before = snapshot(target)
    cache.mkdir()
    link = cache / (model if linked == "model" else linked)
    os.symlink(target, link)
    assert weight_cache.usage().total == 0
    done = weight_cache.clear()
    assert done.foreign == [link] and done.removed.total == 0 and not done.errors
    assert link.is_symlink() and snapshot(target) == before
    status, out, _ = run_cli(capsys, "clear")
    assert status == 0 and f"left alone: 1 item(s) the cache did not write: {link} (a symbolic link, " \
                           "not followed)" in out
    assert snapshot(target) == before


def test_usage_and_verify_count_only_what_the_cache_wrote(cache):
    entry = fill(weight_cache.EntryKey("ab" * 32, 3, "float32"))
    put(cache / "weights" / "my-checkpoint" / "model.safetensors", "x" * 10_000)
    put(cache / "weights" / f"{'ef' * 16}-5-float32" / "model.safetensors", "y" * 10_000)
    found = weight_cache.usage()
    assert found.entries.count == 1 and found.total < 10_000 and len(found.foreign) == 2
    assert weight_cache.verify() == []  # the user's folders are not corrupt entries
    (entry / "manifest.json").unlink()  # the marker still says the cache wrote it
    assert [p.detail for p in weight_cache.verify()] == ["incomplete (no readable manifest)"]


def test_a_fresh_entry_carries_the_marker_outside_its_manifest(cache):
    key = weight_cache.EntryKey("ab" * 32, 3, "float32")
    entry = fill(key)
    assert (entry / weight_cache.MARKER).is_file()
    manifest = json.loads((entry / weight_cache.MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "config.json"}
    assert weight_cache.lookup(key) == entry and weight_cache.verify() == []
    (entry / weight_cache.MARKER).unlink()  # an entry of an older version: still used and owned
    assert weight_cache.lookup(key) == entry and weight_cache.usage().entries.count == 1


def test_a_folder_the_cache_did_not_write_at_an_entrys_name_is_kept(cache):
    key = weight_cache.EntryKey("ab" * 32, 3, "float32")
    mine = put(cache / "weights" / key.name / "model.safetensors", "mine")
    assert weight_cache.lookup(key) is None and mine.read_text() == "mine"  # neither used nor removed
    with pytest.raises(FileExistsError, match=rf"{key.name} stands where .* did not write it .*move it away"):
        fill(key)
    assert mine.read_text() == "mine" and [p.name for p in mine.parent.parent.iterdir()] == [key.name]


def test_a_fill_sweeps_only_its_own_temporaries(cache):
    root = cache / "weights"
    name = weight_cache.EntryKey("cd" * 32, 7, "float32").name
    ours, theirs = root / f".{name}.abc_1234.tmp", root / ".backup.tmp"
    for folder in (ours, theirs):
        put(folder / "model.safetensors", "partial")
        os.utime(folder, OLD)
    fill(weight_cache.EntryKey("ab" * 32, 3, "float32"))
    assert not ours.exists() and (theirs / "model.safetensors").read_text() == "partial"


# --- a cache path that is not a folder -------------------------------------------------------------
@pytest.mark.parametrize("action", ["info", "verify", "clear"])
def test_a_cache_path_at_a_file_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, action):
    file = put(tmp_path / "cache-file", "not a folder")
    monkeypatch.setenv("TL_GEOMETRY_CACHE", str(file))
    status, out, err = run_cli(capsys, action)
    assert status == 2 and out == ""
    assert err.splitlines() == [f"tl-geometry cache: error: TL_GEOMETRY_CACHE={file} is a file, not a "
                                "folder: point it at a folder (or unset it)"]
    monkeypatch.setenv("TL_GEOMETRY_CACHE", str(file / "sub"))
    status, _, err = run_cli(capsys, action)
    assert status == 2 and f"cannot be created: {file} is a file, not a folder" in err
    assert file.read_text() == "not a folder"


@pytest.mark.parametrize("sub", ["weights", "sha256"])
@pytest.mark.parametrize("action", ["info", "verify", "clear"])
def test_a_cache_subfolder_at_a_file_is_one_line_and_exit_2(cache, capsys, sub, action):
    file = put(cache / sub, "not a folder")
    status, out, err = run_cli(capsys, action)
    assert status == 2 and out == "" and len(err.splitlines()) == 1
    assert f"{file} is a file, not a folder: the cache keeps" in err and "Move it away" in err
    assert file.read_text() == "not a folder"


def test_the_default_cache_at_a_file_names_the_setting(tmp_path, monkeypatch):
    monkeypatch.delenv("TL_GEOMETRY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    put(tmp_path / "tl_geometry", "not a folder")
    with pytest.raises(CacheFolderError, match=r"\(\$XDG_CACHE_HOME/tl_geometry\) is a file, not a folder: "
                                               "move that away, or set TL_GEOMETRY_CACHE to a folder"):
        model_files.cache_dir()


def test_the_command_in_a_fresh_process_says_so_without_a_traceback(tmp_path):
    file = put(tmp_path / "cache-file", "not a folder")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TL_GEOMETRY_CACHE": str(file)}
    run = subprocess.run([sys.executable, "-m", "tl_geometry", "cache", "info"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.splitlines() == [f"tl-geometry cache: error: TL_GEOMETRY_CACHE={file} is a file, "
                                       "not a folder: point it at a folder (or unset it)"]


# --- loads -----------------------------------------------------------------------------------------
def fake_gguf_source(folder: Path, calls: list[str]) -> models._Source:
    """A GGUF source whose de-quantisation is the tiny model (``models._from_pretrained`` patched:
    the caller restores it); ``calls`` counts the de-quantisations."""
    path = write_gguf(folder / "fake.gguf", add_bos=True)
    real = models._from_pretrained

    def from_pretrained(src, dtype, device_map=None):
        if src.gguf_file is not None:
            calls.append(src.gguf_file)
            return tiny_model_and_tokenizer()
        return real(src, dtype, device_map)

    models._from_pretrained = from_pretrained  # type: ignore[assignment]
    return models._Source("fake", path.parent, path.name, None)


def test_a_load_with_the_cache_at_a_file_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_from_pretrained", models._from_pretrained)  # restored afterwards
    calls: list[str] = []
    source = fake_gguf_source(tmp_path, calls)
    file = put(tmp_path / "cache-file", "not a folder")
    monkeypatch.setenv("TL_GEOMETRY_CACHE", str(file))
    with pytest.raises(CacheFolderError, match=rf"TL_GEOMETRY_CACHE={file} is a file, not a folder: point it"):
        models._load_hf(source, torch.float32)
    assert calls == [] and file.read_text() == "not a folder"  # refused before any de-quantisation


def test_assembling_into_a_model_folder_that_is_a_file_is_a_clear_error(cache, tmp_path):
    import hashlib

    part = put(tmp_path / "part01.bin", "whole file")
    blocker = put(cache / "m", "not a folder")
    with pytest.raises(CacheFolderError, match=rf"{blocker} is a file, not a folder: m.gguf is assembled"):
        model_files.assemble([part], cache / "m" / "m.gguf", size=10,
                             sha256=hashlib.sha256(b"whole file").hexdigest(), fix="x")


def test_a_model_loaded_from_the_cache_survives_its_files_being_cut_or_cleared(cache, tmp_path):
    """In a child process: were the weights still mapped from the entry's model.safetensors,
    cutting that file short would kill it with SIGBUS at the next forward."""
    script = textwrap.dedent(f"""
        import os, sys, warnings
        import torch
        sys.path[:0] = [{str(TESTS)!r}, {str(Path(__file__).parent)!r}]
        warnings.simplefilter("ignore")
        from pathlib import Path
        from test_cache_ownership import fake_gguf_source
        from tl_geometry.inputs import models, weight_cache
        calls = []
        source = fake_gguf_source(Path({str(tmp_path)!r}), calls)
        models._load_hf(source, torch.float32)  # de-quantised, written, read back
        loaded = models._load_hf(source, torch.float32)  # read from the entry, as later processes do
        assert calls == ["fake.gguf"], calls
        entry = loaded.cache_entry
        ids = torch.arange(12).reshape(2, 6)
        with torch.no_grad():
            want = loaded.model(ids).logits
        weights = entry / "model.safetensors"
        size = weights.stat().st_size
        os.truncate(weights, 0)  # by hand, in place: what kills a process that maps the file
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, want), "cut short"
        with open(weights, "r+b") as handle:  # copied over in place (cp onto it)
            handle.write(bytes(size))
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, want), "overwritten"
        done = weight_cache.clear()
        assert done.removed.entries.count == 1 and not entry.exists()
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, want), "cleared"
        assert not [line for line in open("/proc/self/maps") if str(entry) in line], "still mapped"
        print("ok")
    """)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TL_GEOMETRY_CACHE": str(cache)}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, f"exit status {run.returncode} (-7: SIGBUS):\n{run.stderr[-3000:]}"
    assert run.stdout.splitlines() == ["ok"]
