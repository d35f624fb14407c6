"""The weight cache's integrity without a real model: edits that keep the mtime are re-hashed,
every write renames a new file into place (readers keep the old one), and ``tl-geometry cache
info | clear | verify``. Every test runs on its own cache in tmp_path."""

from __future__ import annotations

import hashlib
import mmap
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo_paths import REPO

from tl_geometry.cli.main import main
from tl_geometry.inputs import model_files, weight_cache
from tl_geometry.inputs.model_files import assemble, atomic_write_text, file_sha256

ROOT = REPO
OLD = 1_600_000_000 * 10**9  # a file time long past, in ns


@pytest.fixture(autouse=True)
def cache(own_cache: Path) -> Path:
    """Every test here writes into its own user cache, never the user's."""
    return own_cache


@pytest.fixture
def hashes(monkeypatch) -> list[int]:
    """Counts the files read in full to hash them."""
    calls: list[int] = []
    real = model_files._hash_stream

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(model_files, "_hash_stream", counting)
    return calls


def source_file(path: Path, size: int = 64 * 1024, seed: int = 1) -> Path:
    """A fake GGUF file whose times lie in the past, as a downloaded model's do."""
    path.write_bytes(bytes((seed * 31 + i * 7) % 251 for i in range(size)))
    os.utime(path, ns=(OLD, OLD))
    time.sleep(0.02)  # what follows happens in a later clock tick, as it does for a real file
    return path


def edit_keeping_times(path: Path, offset: int = 8192) -> None:
    """Overwrite 4 KB in place, then set the times back (``touch -r``)."""
    before = path.stat()
    with path.open("r+b") as handle:
        handle.seek(offset)
        handle.write(b"\xee" * 4096)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (before.st_size, before.st_mtime_ns, before.st_ino)


def fill(key: weight_cache.EntryKey, weights: bytes = b"w" * 5000) -> Path:
    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(weights)
        (folder / "config.json").write_text('{"model_type": "llama"}')

    return weight_cache.store(key, write)


# --- task 1: a digest is trusted only while the file's stamp is the one hashed -----------------
def test_an_edit_that_keeps_the_mtime_is_hashed_again(tmp_path, hashes):
    path = source_file(tmp_path / "m.gguf")
    first = file_sha256(path)
    assert file_sha256(path) == first and len(hashes) == 1  # remembered
    edit_keeping_times(path)
    second = file_sha256(path)
    assert len(hashes) == 2 and second == model_files.hash_file(path) != first
    assert file_sha256(path) == second and len(hashes) == 3  # hash_file above read it once more


@pytest.mark.parametrize("how", ["cp -p", "rsync -t"])
def test_a_copy_that_keeps_size_and_mtime_is_hashed_again(tmp_path, hashes, how):
    path = source_file(tmp_path / "m.gguf")
    other = source_file(tmp_path / "other.gguf", seed=2)  # same size and times, other bytes
    first = file_sha256(path)
    inode = path.stat().st_ino
    if how == "cp -p":  # into the same inode, times copied
        shutil.copy2(other, path)
        assert path.stat().st_ino == inode
    else:  # a new file renamed over it, times copied
        partial = tmp_path / ".m.gguf.partial"
        shutil.copy2(other, partial)
        os.replace(partial, path)
        assert path.stat().st_ino != inode
    assert path.stat().st_mtime_ns == OLD and path.stat().st_size == other.stat().st_size
    assert file_sha256(path) == model_files.hash_file(other) != first


def test_the_weight_cache_sees_an_edited_source_and_verify_calls_the_old_entry_stale(tmp_path):
    gguf = source_file(tmp_path / "m.gguf")
    old_key = weight_cache.entry_key(gguf, "float32")
    old_entry = fill(old_key)
    assert weight_cache.lookup(weight_cache.entry_key(gguf, "float32")) == old_entry
    assert weight_cache.verify() == []
    edit_keeping_times(gguf)
    new_key = weight_cache.entry_key(gguf, "float32")
    assert new_key.sha256 == model_files.hash_file(gguf) != old_key.sha256
    assert weight_cache.lookup(new_key) is None  # the load de-quantises the edited file again
    new_entry = fill(new_key, b"v" * 5000)
    assert [(p.kind, p.path) for p in weight_cache.verify()] == [("stale", old_entry)]
    assert "has changed since" in str(weight_cache.verify()[0])
    gguf.unlink()
    assert {(p.kind, p.path) for p in weight_cache.verify()} == {("stale", old_entry), ("stale", new_entry)}
    assert "which is gone" in str(weight_cache.verify()[0])


def test_verify_finds_every_kind_of_damage(tmp_path):
    gguf = source_file(tmp_path / "m.gguf")
    entry = fill(weight_cache.entry_key(gguf, "float32"))
    other = fill(weight_cache.entry_key(gguf, "bfloat16"))
    third = fill(weight_cache.EntryKey("ab" * 32, 3, "float32", "x.gguf"))  # no source path
    assert weight_cache.verify() == []
    flipped = bytearray((entry / "model.safetensors").read_bytes())
    flipped[100] ^= 1
    (entry / "model.safetensors").write_bytes(flipped)  # same size, other bytes
    (other / "config.json").unlink()
    (other / "extra.safetensors").write_bytes(b"x")
    (third / "manifest.json").unlink()
    found = {(p.kind, p.path.relative_to(tmp_path).as_posix()): p.detail for p in weight_cache.verify()}
    base = "cache/weights"
    assert found == {
        ("corrupt", f"{base}/{entry.name}/model.safetensors"): "does not match its recorded sha256",
        ("corrupt", f"{base}/{other.name}/config.json"): "missing",
        ("corrupt", f"{base}/{other.name}/extra.safetensors"): "a file the entry's manifest does not list",
        ("corrupt", f"{base}/{third.name}"): "incomplete (no readable manifest)",
    }


def test_verify_finds_a_remembered_digest_that_no_longer_holds(tmp_path):
    path = source_file(tmp_path / "m.gguf")
    file_sha256(path)
    assert weight_cache.verify() == []
    model_files.remember_sha256(path, "0" * 64)  # a record that claims other bytes for this stamp
    assert file_sha256(path) == "0" * 64  # what a load would trust
    (problem,) = weight_cache.verify()
    assert problem.kind == "corrupt" and problem.path == path.resolve() and "remembered" in problem.detail


# --- task 2: every write is a new file renamed into place ---------------------------------------
def test_a_rewritten_text_file_is_a_new_inode_and_a_reader_keeps_the_old_bytes(tmp_path):
    path = tmp_path / "cache" / "sha256" / "memo.json"
    atomic_write_text(path, "old contents")
    with path.open("rb") as reader:
        inode = os.fstat(reader.fileno()).st_ino
        atomic_write_text(path, "new")
        assert path.stat().st_ino != inode and reader.read() == b"old contents"
    assert path.read_text() == "new"
    assert [p.name for p in path.parent.iterdir()] == ["memo.json"]  # no temporary left


def test_rebuilding_an_entry_leaves_a_mapped_reader_its_old_file(tmp_path):
    key = weight_cache.EntryKey("cd" * 32, 7, "float32", "m.gguf")
    entry = fill(key, b"a" * 8192)
    weights = entry / "model.safetensors"
    with weights.open("rb") as reader, mmap.mmap(reader.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        inode = os.fstat(reader.fileno()).st_ino
        bad = entry / ".manifest.json.new"  # a damaged manifest, itself renamed into place
        bad.write_text("{")
        os.replace(bad, entry / "manifest.json")
        with pytest.warns(UserWarning, match="no readable manifest"):
            assert weight_cache.lookup(key) is None
        assert fill(key, b"b" * 8192) == entry
        assert weights.stat().st_ino != inode  # a new file: the mapped one was never cut short
        assert mapped[:] == b"a" * 8192 and reader.read() == b"a" * 8192
    assert weights.read_bytes() == b"b" * 8192 and weight_cache.verify() == []


def test_assemble_replaces_a_damaged_file_without_touching_an_open_one(tmp_path):
    part = tmp_path / "part01.bin"
    part.write_bytes(b"whole file")
    target = tmp_path / "cache" / "m" / "m.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"damaged!!!")  # same size, other bytes
    with target.open("rb") as reader:
        inode = os.fstat(reader.fileno()).st_ino
        assemble([part], target, size=10, sha256=hashlib.sha256(b"whole file").hexdigest(), fix="x")
        assert target.stat().st_ino != inode and reader.read() == b"damaged!!!"
    assert target.read_bytes() == b"whole file"


def test_clear_unlinks_so_a_mapped_reader_keeps_reading(cache):
    entry = fill(weight_cache.EntryKey("ef" * 32, 1, "float32"), b"c" * 8192)
    with (entry / "model.safetensors").open("rb") as reader, \
            mmap.mmap(reader.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
        done = weight_cache.clear()
        assert not entry.exists() and done.removed.entries.count == 1 and not done.errors
        assert mapped[:] == b"c" * 8192


# --- task 3: tl-geometry cache info | clear | verify --------------------------------------------
def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    status = main(["cache", *argv])
    out, err = capsys.readouterr()
    return status, out, err


def fill_everything(cache: Path, tmp_path: Path) -> dict[str, Path]:
    """An entry, an assembled GGUF file, remembered digests, an old and a young temporary, and
    files that are not the cache's own."""
    from tl_geometry.inputs.models import MODELS

    gguf = source_file(tmp_path / "m.gguf")
    entry = fill(weight_cache.entry_key(gguf, "float32"), b"w" * 300_000)
    name = next(n for n, spec in MODELS.items() if spec.split is not None or spec.files.size is not None)
    assembled = cache / name / MODELS[name].gguf_name
    assembled.parent.mkdir()
    assembled.write_bytes(b"g" * 2048)
    old_tmp = cache / "weights" / f".{entry.name}.dead1234.tmp"  # the names store() gives them
    young_tmp = cache / "weights" / f".{entry.name}.busy1234.tmp"
    for folder in (old_tmp, young_tmp):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"partial")
    os.utime(old_tmp, (0, 0))
    foreign = [cache / "notes.txt", cache / name / "mine.gguf"]
    for path in foreign:
        path.write_text("not the cache's")
    return {"entry": entry, "assembled": assembled, "old_tmp": old_tmp, "young_tmp": young_tmp,
            "foreign0": foreign[0], "foreign1": foreign[1]}


def test_cache_info_prints_location_origin_and_size(cache, tmp_path, capsys):
    status, out, _ = run_cli(capsys, "info")
    assert status == 0 and f"cache: {cache}" in out and "$TL_GEOMETRY_CACHE" in out
    assert "total:" in out and " 0 B" in out
    fill_everything(cache, tmp_path)
    status, out, _ = run_cli(capsys, "info")
    lines = {line.split(":")[0].strip(): line.split(":", 1)[1].split() for line in out.splitlines()}
    assert lines["weight-cache entries"][0] == "1" and lines["assembled GGUF files"][:3] == ["1", "2.0", "KiB"]
    assert lines["temporary files"][0] == "2" and lines["weight cache"] == ["on"]
    total = weight_cache.usage().total
    assert 300_000 < total < 310_000 and lines["total"] == [f"{total / 1024:.1f}", "KiB"]


def test_cache_info_names_the_default_rule(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("TL_GEOMETRY_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv(weight_cache.ENV, "0")
    status, out, _ = run_cli(capsys, "info")
    assert status == 0 and f"cache: {tmp_path / 'xdg' / 'tl_geometry'}" in out
    assert "$XDG_CACHE_HOME/tl_geometry, as $TL_GEOMETRY_CACHE is not set" in out
    assert "weight cache: off ($TL_GEOMETRY_WEIGHT_CACHE)" in out
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert model_files.cache_origin().startswith("the default")
    assert model_files.cache_dir() == Path.home() / ".cache" / "tl_geometry"


def test_cache_clear_removes_only_what_the_cache_owns(cache, tmp_path, capsys):
    paths = fill_everything(cache, tmp_path)
    before = weight_cache.usage()
    status, out, _ = run_cli(capsys, "clear")
    assert status == 0 and out.startswith(f"cleared {cache}: ") and "freed" in out.splitlines()[0]
    assert "left alone: 1 temporary file(s)" in out
    for name in ("entry", "assembled", "old_tmp"):
        assert not paths[name].exists(), name
    for name in ("young_tmp", "foreign0", "foreign1"):  # a load may still write the young one
        assert paths[name].exists(), name
    assert not (cache / "sha256").exists()
    after = weight_cache.usage()
    assert (after.entries.count, after.assembled.count, after.digests.count, after.temporary.count) == (0, 0, 0, 1)
    assert after.total == len(b"partial") and before.total > 300_000
    status, out, _ = run_cli(capsys, "clear")
    assert status == 0 and "0 B freed" in out.splitlines()[0]


def test_cache_verify_exits_1_on_a_corrupt_entry_and_0_on_a_good_cache(cache, tmp_path, capsys):
    gguf = source_file(tmp_path / "m.gguf")
    entry = fill(weight_cache.entry_key(gguf, "float32"))
    assert run_cli(capsys, "verify")[:2] == (0, "")
    weights = entry / "model.safetensors"
    weights.write_bytes(b"W" + weights.read_bytes()[1:])
    status, out, err = run_cli(capsys, "verify")
    assert status == 1 and out.splitlines() == [f"corrupt: {weights}: does not match its recorded sha256"]
    assert "1 corrupt" in err
    with pytest.warns(UserWarning, match="does not match its recorded sha256"):
        assert weight_cache.lookup(weight_cache.entry_key(gguf, "float32")) is None  # removed
    assert run_cli(capsys, "verify")[:2] == (0, "")


def test_cache_verify_reports_a_stale_entry_without_failing(cache, tmp_path, capsys):
    """Entries are named by their content: one whose source file changed is whole (a file with
    the same bytes elsewhere still uses it), so verify lists it and still exits 0."""
    gguf = source_file(tmp_path / "m.gguf")
    fill(weight_cache.entry_key(gguf, "float32"))
    gguf.unlink()
    status, out, err = run_cli(capsys, "verify")
    assert status == 0 and out.startswith("stale: ") and "1 stale entry: whole, only taking space" in err


def test_the_command_in_a_fresh_process_loads_no_model(cache, tmp_path):
    gguf = source_file(tmp_path / "m.gguf")
    entry = fill(weight_cache.entry_key(gguf, "float32"))
    (entry / "config.json").write_text("{}")
    script = ("import sys\nfrom tl_geometry.cli.main import main\nstatus = main(sys.argv[1:])\n"
              "print(*(m in sys.modules for m in ('transformers', 'transformer_lens', 'matplotlib')))\n"
              "raise SystemExit(status)\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TL_GEOMETRY_CACHE": str(cache)}
    runs = {action: subprocess.run([sys.executable, "-c", script, "cache", action], env=env,
                                   capture_output=True, text=True, timeout=300)
            for action in ("verify", "clear")}
    assert runs["verify"].returncode == 1 and "Traceback" not in runs["verify"].stderr
    assert runs["verify"].stdout.splitlines() == [f"corrupt: {entry / 'config.json'}: 2 bytes, not 23",
                                                  "False False False"]
    assert runs["clear"].returncode == 0 and runs["clear"].stdout.splitlines()[-1] == "False False False"
    again = subprocess.run([sys.executable, "-m", "tl_geometry", "cache", "verify"], env=env,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and again.stdout == ""
