"""``head_scores``: the head scores other tools use, from a model's attention patterns (SPEC §9).

One forward pass per kind of sequence, caching ``hook_pattern`` only: repeated random tokens
(previous-token, duplicate-token, induction), real-text windows (sink rate, Sink^ε) and the same
windows with a random needle (retrieval). The math is in :mod:`tl_geometry.functional.head_scores`.

Every sequence starts as the model was trained (SPEC §1): with BOS where it was trained with one
(:func:`tl_geometry.inputs.models.trained_with_bos`, the loader's record, never the tokenizer's
own attribute), else with its first text token. Sequences the caller passes are checked for it,
and for padding: the scores read every position as text, so a window that starts otherwise or
holds pad tokens would move the sink rate and Sink^ε without a word.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..functional import head_scores as _scores
from ..inputs.cache import PATTERN_HOOK
from ..inputs.models import trained_with_bos
from ..inputs.text import text_windows
from ..inputs.tokens import check_token_ids

#: Sequences built when none are passed: random repeated sequences and text windows.
N_REPEATED, N_WINDOWS, WINDOW_LENGTH = 8, 8, 64
#: The patterns of one forward (every layer, float32) stay below this size: more sequences run
#: in batches, so the number of windows is bounded by the text, not by memory.
PATTERN_BUDGET = 1 << 30
#: Seeds are whole numbers in ``[0, MAX_SEED)``.
MAX_SEED = 2**63


def head_scores(model: Any, *, repeated: Tensor | None = None, windows: Tensor | None = None,
                seed: int = 0):
    """Per (layer, head), the scores of SPEC §9 as a ``pandas.DataFrame``.

    Columns ``layer, head, previous_token, duplicate_token, induction, sink_rate, retrieval``;
    ``df.attrs["sink_epsilon"]`` is the model's Sink^ε (share of heads with ``sink_rate > 0.3``,
    Gu et al., ICLR 2025), ``df.attrs["epsilon"]`` the threshold, ``df.attrs["repeat"]`` R and
    ``df.attrs["trained_with_bos"]`` whether the sequences start with BOS.

    Every sequence starts as the model was trained (:func:`tl_geometry.inputs.models.trained_with_bos`):
    with BOS for SmolLM2 and Gemma-3, with a text token for Qwen2.5-Coder. Sequences passed in
    that start otherwise, or that hold pad tokens, are refused with a ``ValueError``.

    Args:
        model: a TransformerLens model (``HookedTransformer`` or ``TransformerBridge``).
        repeated: ``[batch, 2R]`` token ids, ``R`` tokens repeated twice, after BOS where the
            model was trained with one (``[batch, 1 + 2R]``); default: 8 sequences with
            ``R = 32`` drawn from ``seed`` uniformly over the vocabulary without special tokens,
            at the token level (no detokenise round trip).
        windows: ``[batch, T]`` real-text token ids (``T ≥ 4``), starting as the model was
            trained and without padding; default: 8 windows of 64 tokens of the built-in sample
            text (:func:`tl_geometry.text_windows`). Read for ``sink_rate`` and, with a random
            32-token needle inserted at the middle and its first 16 tokens repeated at the end,
            for ``retrieval``.
        seed: seeds the random tokens (repeated sequences and needles); a whole number in
            ``[0, 2**63)``.

    Example:
        >>> scores = tl_geometry.head_scores(model)                        # doctest: +SKIP
        >>> scores.nlargest(3, "induction"), scores.attrs["sink_epsilon"]  # doctest: +SKIP
    """
    import pandas as pd

    cfg = _check_model(model)
    seed = _check_seed(seed)
    # Without windows, text_windows asks (and warns where nothing says) itself.
    with_bos = trained_with_bos(model, warn=windows is not None)
    start = 1 if with_bos else 0
    generator = torch.Generator().manual_seed(seed)
    vocabulary = ordinary_tokens(model)
    if repeated is None:
        body = _draw(vocabulary, (N_REPEATED, _scores.REPEAT_LENGTH), generator)
        first = [torch.full((N_REPEATED, 1), _bos(model))] if with_bos else []
        repeated = torch.cat([*first, body, body], dim=1)
    repeat = _check_repeated(repeated, cfg.d_vocab, start)
    if windows is None:
        windows = text_windows(model, n_seqs=N_WINDOWS, seq_len=WINDOW_LENGTH)
    _check_windows(windows, cfg.d_vocab)
    for name, tokens in (("repeated", repeated), ("windows", windows)):
        _check_first_token(model, tokens, name, with_bos)
        _check_no_padding(model, tokens, name)
    needles = _draw(vocabulary, (windows.shape[0], _scores.NEEDLE_LENGTH), generator)
    middle, queries, keys = _scores.retrieval_layout(windows.shape[1])
    with_needle = torch.cat([windows[:, :middle], needles, windows[:, middle:],
                             needles[:, :_scores.NEEDLE_REPEATED]], dim=1)

    columns = {
        **_layer_means(model, repeated, {
            "previous_token": lambda p: _scores.previous_token_score(p, start),
            "duplicate_token": lambda p: _scores.duplicate_token_score(p, repeat, start),
            "induction": lambda p: _scores.induction_score(p, repeat, start),
        }),
        **_layer_means(model, windows, {"sink_rate": _scores.sink_rate}),
        **_layer_means(model, with_needle,
                       {"retrieval": lambda p: _scores.argmax_share(p, queries, keys)}),
    }
    n_layers, n_heads = cfg.n_layers, cfg.n_heads
    frame = pd.DataFrame({
        "layer": torch.arange(n_layers).repeat_interleave(n_heads).numpy(),
        "head": torch.arange(n_heads).repeat(n_layers).numpy(),
        # Under a device map each layer's scores live on its own device: gather them on the CPU.
        **{name: torch.cat([v.cpu() for v in columns[name]]).numpy() for name in _scores.SCORE_NAMES},
    })
    frame.attrs.update(sink_epsilon=_scores.sink_epsilon(torch.cat([v.cpu() for v in columns["sink_rate"]])),
                       epsilon=_scores.SINK_EPSILON, repeat=repeat, trained_with_bos=with_bos)
    return frame


def ordinary_tokens(model: Any) -> Tensor:
    """Token ids the random sequences draw from: the tokenizer's vocabulary (not the embedding's
    padding rows) without its special tokens (SPEC §9)."""
    d_vocab = int(model.cfg.d_vocab)
    tokenizer = getattr(model, "tokenizer", None)
    size = min(d_vocab, len(tokenizer)) if tokenizer is not None else d_vocab
    keep = torch.ones(size, dtype=torch.bool)
    special = [i for i in getattr(tokenizer, "all_special_ids", []) if 0 <= i < size]
    keep[special] = False
    return keep.nonzero().flatten()


def _draw(vocabulary: Tensor, shape: tuple[int, int], generator: torch.Generator) -> Tensor:
    """Tokens drawn uniformly (with replacement) from ``vocabulary``."""
    return vocabulary[torch.randint(len(vocabulary), shape, generator=generator)]


def _check_model(model: Any) -> Any:
    """``model.cfg`` of a TransformerLens model; a clear error for anything else (``None``)."""
    cfg = getattr(model, "cfg", None)
    sizes = [getattr(cfg, name, None) for name in ("n_layers", "n_heads", "d_vocab")]
    if (not callable(getattr(model, "run_with_cache", None))
            or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in sizes)):
        got = "None" if model is None else type(model).__name__
        raise ValueError(f"head_scores needs a TransformerLens model (a TransformerBridge from "
                         f"tl_geometry.load_model, or a HookedTransformer) with run_with_cache and "
                         f"cfg.n_layers, cfg.n_heads, cfg.d_vocab; got {got}.")
    return cfg


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be a whole number in [0, 2**63), got {seed!r} "
                         f"({type(seed).__name__}); e.g. seed=0.")
    if not 0 <= int(seed) < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63) (a 64-bit generator seed), got {int(seed)}; "
                         "pick a smaller whole number, e.g. seed=0.")
    return int(seed)


def _label(model: Any) -> str:
    name = getattr(getattr(model, "cfg", None), "model_name", None)
    return repr(name) if isinstance(name, str) and name else f"this {type(model).__name__}"


def _bos(model: Any) -> int:
    bos = getattr(getattr(model, "tokenizer", None), "bos_token_id", None)
    if bos is None:
        raise ValueError(f"{_label(model)} was trained with BOS at the start of a sequence but its "
                         "tokenizer has no BOS token; set tokenizer.bos_token, or pass repeated= "
                         "and windows= token ids that start with the model's BOS.")
    return int(bos)


def _check_ids(tokens: Any, name: str, layout: str, d_vocab: int) -> None:
    """A ``[batch, pos]`` tensor of integer token ids in the vocabulary, with a sequence in it."""
    if not isinstance(tokens, Tensor) or tokens.ndim != 2:
        shape = list(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise ValueError(f"{name} must be {layout}, got {shape}.")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise ValueError(f"{name} must hold integer token ids, got dtype {tokens.dtype}; token ids "
                         f"are whole numbers: pass tokens.long() if they are, or the tokenizer's ids.")
    if tokens.shape[0] == 0:
        raise ValueError(f"{name} holds no sequences (shape {list(tokens.shape)}); pass at least one, "
                         f"{layout}.")
    check_token_ids(tokens, d_vocab, name)


def _check_repeated(repeated: Any, d_vocab: int, start: int) -> int:
    """``R`` of a repeated sequence (``[batch, start + 2R]``); a clear error when it is not one."""
    if start:
        layout = "[batch, 1 + 2R] token ids (BOS + R tokens repeated twice, R ≥ 2)"
    else:
        layout = ("[batch, 2R] token ids (R tokens repeated twice, R ≥ 2, no BOS: the model was "
                  "trained without one)")
    _check_ids(repeated, "repeated", layout, d_vocab)
    length = repeated.shape[1] - start
    if length < 4 or length % 2:
        raise ValueError(f"repeated must be {layout}, got {list(repeated.shape)}.")
    repeat = length // 2
    first, second = repeated[:, start:start + repeat], repeated[:, start + repeat:]
    if not torch.equal(first, second):
        after = " (after BOS)" if start else ""
        raise ValueError(f"repeated's second half{after} must equal its first: positions "
                         f"{start}..{start + repeat - 1} and {start + repeat}..{start + 2 * repeat - 1} "
                         "hold the same tokens.")
    return repeat


def _check_windows(windows: Any, d_vocab: int) -> None:
    layout = ("[batch, T] real-text token ids (T ≥ 4) starting as the model was trained; "
              "tl_geometry.text_windows(model, n_seqs=8, seq_len=64) makes them")
    _check_ids(windows, "windows", layout, d_vocab)
    if windows.shape[1] < 4:
        raise ValueError(f"windows must be {layout}, got {list(windows.shape)}.")


def _rows(mask: Tensor) -> str:
    rows = mask.nonzero().flatten().tolist()
    return f"{rows[:8]}{' …' if len(rows) > 8 else ''}"


def _check_first_token(model: Any, tokens: Tensor, name: str, with_bos: bool) -> None:
    """Sequences start with BOS where the model was trained with one, and never where it was not
    (SPEC §1): the first key is the sink either way."""
    bos = getattr(getattr(model, "tokenizer", None), "bos_token_id", None)
    if bos is None:
        return
    first = tokens[:, 0].cpu()
    fix = ("build them with tl_geometry.text_windows(model, text, n_seqs=..., seq_len=...), which "
           "starts each window as the model was trained")
    if with_bos and (first != bos).any():
        raise ValueError(f"{name}: sequence(s) {_rows(first != bos)} do not start with BOS (id {bos}), "
                         f"but {_label(model)} was trained with BOS at the start of a sequence; put "
                         f"BOS first, or {fix}.")
    if not with_bos and (first == bos).any():
        raise ValueError(f"{name}: sequence(s) {_rows(first == bos)} start with the tokenizer's BOS "
                         f"(id {bos}), but {_label(model)} was trained without BOS at the start of a "
                         f"sequence (its first text token is the sink); drop that token "
                         f"(tokens[:, 1:]), or {fix}.")


def _special_ids(tokenizer: Any, *names: str) -> set[int]:
    ids = (getattr(tokenizer, name, None) for name in names)
    return {int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)}


def _check_no_padding(model: Any, tokens: Tensor, name: str) -> None:
    """No pad tokens: every position is read as text (no attention mask).

    A dedicated pad id (Gemma-3's ``<pad>``) is refused wherever it stands. A pad id that is
    also the tokenizer's BOS or EOS (SmolLM2 pads with its EOS ``<|im_end|>``) is a document
    separator where it stands alone, so only two in a row, a run of padding, are refused.
    """
    tokenizer = getattr(model, "tokenizer", None)
    pad = _special_ids(tokenizer, "pad_token_id")
    if not pad:
        return
    (pad_id,) = pad
    is_pad = tokens.cpu() == pad_id
    if pad_id in _special_ids(tokenizer, "bos_token_id", "eos_token_id"):
        padded = (is_pad[:, 1:] & is_pad[:, :-1]).any(-1)
        what = f"runs of the pad token (id {pad_id}, also the tokenizer's BOS or EOS)"
    else:
        padded = is_pad.any(-1)
        what = f"the pad token (id {pad_id})"
    if padded.any():
        raise ValueError(f"{name}: sequence(s) {_rows(padded)} hold {what}. head_scores takes no "
                         "attention mask and reads every position as text, so padding would move "
                         "the sink rate and Sink^ε; pass sequences of equal length without padding, "
                         "e.g. windows cut from one text by tl_geometry.text_windows(model, text, "
                         "n_seqs=..., seq_len=...).")


def _layer_means(model: Any, tokens: Tensor,
                 scores: dict[str, Callable[[Tensor], Tensor]]) -> dict[str, list[Tensor]]:
    """Per score and layer, its per-head mean over every sequence of ``tokens``.

    The sequences run in batches whose patterns fit :data:`PATTERN_BUDGET`; every sequence has
    as many queries, so the mean is the batches' means weighted by their sizes (one batch, the
    default: its mean, bit for bit).
    """
    n_seqs, n_pos = tokens.shape
    per_sequence = model.cfg.n_layers * model.cfg.n_heads * n_pos * n_pos * 4
    batch = max(1, min(n_seqs, PATTERN_BUDGET // per_sequence))
    parts: dict[str, dict[int, list[Tensor]]] = {name: {} for name in scores}
    for lo in range(0, n_seqs, batch):
        chunk = tokens[lo:lo + batch]
        for layer, pattern in _patterns(model, chunk).items():
            for name, score in scores.items():
                parts[name].setdefault(layer, []).append(score(pattern) * (len(chunk) / n_seqs))
    return {name: [torch.stack(values).sum(0) for values in layers.values()]
            for name, layers in parts.items()}


def _patterns(model: Any, tokens: Tensor) -> dict[int, Tensor]:
    """``hook_pattern`` of every layer for ``tokens`` (only those hooks are cached)."""
    names = {PATTERN_HOOK.format(layer=layer): layer for layer in range(model.cfg.n_layers)}
    device = getattr(model.cfg, "device", None) or "cpu"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens.to(device), names_filter=lambda name: name in names)
    return {layer: cache[name] for name, layer in names.items()}
