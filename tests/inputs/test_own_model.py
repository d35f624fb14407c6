"""Your own model (docs/own_model.md) on a tiny Llama saved with ``save_pretrained``.

Whether the model was trained with BOS decides how every window starts and so which token is the
sink (SPEC §1). ``save_pretrained`` writes no ``add_bos_token``: such a folder is refused at load,
naming the fixes, instead of being analysed without BOS; ``bos=`` (``--bos`` on the command line)
or the key in ``tokenizer_config.json`` says it. Once it is said, the documented routes (the
folder through ``load_model``, and a plain Hugging Face forward through ``from_hf``) cut the same
windows and choose the same sink. The "weak sink" hint never asks for the rule already in use.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

import tl_geometry
from tl_geometry.cli import main as cli
from tl_geometry.inputs import from_hf, models

QUIET = {"n_values": (1, 2), "random_samples": 0, "shuffle_samples": 0}
SEQ_LEN = 40  # the sink check reads queries from position 32 on
TEXT = " ".join(f"t{(7 * i) % 30}" for i in range(400))


def save_tiny(folder: Path, add_bos_token: bool | None) -> Path:
    """A 2-layer Llama (4 query heads, 2 KV heads) and a word-level tokenizer with BOS ``<s>``,
    written by ``save_pretrained``; ``add_bos_token`` added to its tokenizer_config.json unless
    ``None`` (as save_pretrained leaves it)."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers import models as tokenizer_models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1)
    vocab = {"<s>": 0, "<unk>": 1} | {f"t{i}": i + 2 for i in range(30)}
    words = Tokenizer(tokenizer_models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, unk_token="<unk>", bos_token="<s>")
    LlamaForCausalLM(config).eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    settings = folder / "tokenizer_config.json"
    stated = json.loads(settings.read_text(encoding="utf-8"))
    assert "add_bos_token" not in stated  # what save_pretrained writes: the case this file is about
    if add_bos_token is not None:
        settings.write_text(json.dumps({**stated, "add_bos_token": add_bos_token}), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    return {stated: save_tiny(tmp_path_factory.mktemp(f"tiny-{stated}"), stated) for stated in (None, True, False)}


def through_load_model(folder: Path, **kwargs):
    """docs/own_model.md, "Your weights through load_model": windows, cache, analysis."""
    model = tl_geometry.load_model(folder, **kwargs)
    tokens = tl_geometry.text_windows(model, TEXT, n_seqs=2, seq_len=SEQ_LEN)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # random weights: weak sinks, as they say
        return tokens, tl_geometry.analyze_heads(cache, model=model, **QUIET)


def through_from_hf(folder: Path, sink=None):
    """docs/own_model.md, "Plain Hugging Face or nnsight tensors", on windows cut by the folder's
    own tokenizer (``text_windows`` reads the folder's files for BOS)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokens = tl_geometry.text_windows(tokenizer, TEXT, n_seqs=2, seq_len=SEQ_LEN)
    with torch.no_grad():
        out = hf(tokens, output_attentions=True, use_cache=True)
    values = tuple(layer.values for layer in out.past_key_values.layers)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tokens, tl_geometry.analyze_heads(from_hf(out.attentions, values), sink=sink, **QUIET)


# --- (a) a folder that does not say is refused, with the fixes ------------------------------------
def test_a_folder_without_add_bos_token_is_refused_before_its_weights_are_read(folders, monkeypatch):
    monkeypatch.setattr(models, "_load_weights", lambda *a, **k: pytest.fail("weights read before the check"))
    folder = folders[None]
    with pytest.raises(models.ModelLoadError) as refused:
        tl_geometry.load_model(folder)
    message = str(refused.value)
    assert "tokenizer_config.json has no add_bos_token" in message and "which token is the sink" in message
    assert f'add "add_bos_token": true (or false) to {folder / "tokenizer_config.json"}' in message
    assert "load_model(..., bos=True)" in message and "--bos yes" in message
    with pytest.raises(ValueError, match=r"bos must be True .* got 'yes'"):
        tl_geometry.load_model(folder, bos="yes")


def test_a_gguf_file_without_add_bos_token_is_refused_naming_bos(tmp_path, monkeypatch):
    from test_model_files import write_gguf

    monkeypatch.setattr(models, "_load_weights", lambda *a, **k: pytest.fail("weights read before the check"))
    path = write_gguf(tmp_path / "m.gguf")
    with pytest.raises(models.ModelLoadError, match=r"has no tokenizer\.ggml\.add_bos_token.*bos=True") as refused:
        tl_geometry.load_model(path)
    assert "tokenizer_config.json" not in str(refused.value)  # no folder to edit


@pytest.mark.parametrize("bos", [True, False])
def test_bos_says_it_for_a_folder_that_does_not(folders, bos):
    """``bos=`` gives what the key in tokenizer_config.json gives: the same windows and sink."""
    opted, opted_result = through_load_model(folders[None], bos=bos)
    stated, stated_result = through_load_model(folders[bos])
    assert torch.equal(opted, stated) and bool((opted[:, 0] == 0).all()) is bos
    assert opted_result.metadata["sink"]["positions"] == stated_result.metadata["sink"]["positions"]
    assert opted_result.metadata["loading"]["trained_with_bos"] is bos


def test_bos_wins_over_the_files(folders):
    tokens, _ = through_load_model(folders[True], bos=False)
    assert not bool((tokens[:, 0] == 0).any())


def test_the_command_line_refuses_the_folder_and_takes_bos(folders, tmp_path, capsys):
    text = tmp_path / "text.txt"
    text.write_text(TEXT, encoding="utf-8")
    args = ["analyze", "--model", str(folders[None]), "--text", str(text), "--n-seqs", "1",
            "--seq-len", str(SEQ_LEN), "--n-values", "1,2", "--show-n", "2", "--random-samples", "1",
            "--no-progress"]
    with pytest.raises(SystemExit) as refused:
        cli.main(args)
    assert refused.value.code == 2 and "--bos yes" in capsys.readouterr().err
    save = tmp_path / "run.pt"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main([*args, "--bos", "yes", "--save", str(save)]) == 0
    result = tl_geometry.HeadAnalysis.load(save)
    assert result.metadata["loading"]["trained_with_bos"] is True and result.metadata["sink"]["positions"] == [0]


# --- (b) the documented routes choose the same sink ----------------------------------------------
@pytest.mark.parametrize("trained_with_bos", [True, False])
def test_load_model_and_a_plain_hf_forward_choose_the_same_sink(folders, trained_with_bos):
    """Trained with BOS: both windows start with it and the sink is position 0. Trained without:
    no BOS, and the sink is each window's most attended first token (``sink="auto"``, which the
    plain route passes as the page says and ``load_model``'s record implies)."""
    folder = folders[trained_with_bos]
    tokens, loaded = through_load_model(folder)
    plain_tokens, plain = through_from_hf(folder, sink=None if trained_with_bos else "auto")
    assert torch.equal(tokens, plain_tokens) and bool((tokens[:, 0] == 0).all()) is trained_with_bos
    for key in ("rule", "positions"):
        assert loaded.metadata["sink"][key] == plain.metadata["sink"][key], key
    assert loaded.metadata["sink"]["rule"] == ("given" if trained_with_bos else "auto")


# --- (c) the weak-sink hint follows the rule in use ----------------------------------------------
def weak_cache() -> dict:
    """Three layers over 40 positions: layer 0 attends key 5 heavily, layers 1 and 2 key 9
    mildly, nothing favours key 0. ``sink="auto"`` picks key 5 (the largest mean over layers),
    which is the most attended only in layer 0: a weak sink under either rule."""
    g = torch.Generator().manual_seed(3)
    causal = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
    cache = {}
    for layer, (key, lift) in enumerate(((5, 8.0), (9, 2.0), (9, 2.0))):
        logits = 0.1 * torch.randn(2, 2, SEQ_LEN, SEQ_LEN, generator=g)
        logits[..., key] += lift
        cache[f"blocks.{layer}.attn.hook_pattern"] = logits.masked_fill(~causal, -torch.inf).softmax(-1)
        cache[f"blocks.{layer}.attn.hook_v"] = torch.randn(2, SEQ_LEN, 1, 4, generator=g)
    return cache


@pytest.mark.parametrize("sink", [None, 0, "auto"])
def test_the_weak_sink_hint_names_only_a_rule_not_in_use(sink):
    with pytest.warns(UserWarning, match="weak sink") as caught:
        result = tl_geometry.analyze_heads(weak_cache(), sink=sink, **QUIET)
    (warning,) = [str(w.message) for w in caught if "weak sink" in str(w.message)]
    record = result.metadata["sink"]
    summary = " ".join(result.summary().split())
    assert record["weak"] is True and "WEAK SINK" in summary
    if sink == "auto":
        assert record["rule"] == "auto" and record["positions"] == [5, 5]
        assert "sink='auto'" not in warning and "may have no sink" in warning
        assert "sink='auto'" not in summary and "may have no sink" in summary
    else:
        assert record["rule"] == "given" and record["positions"] == [0, 0]
        assert "pass sink='auto'" in warning and "re-run with sink='auto'" in summary
