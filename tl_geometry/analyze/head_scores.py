"""``head_scores``: the head scores other tools use, from a model's attention patterns (SPEC §9).

One forward pass per kind of sequence, caching ``hook_pattern`` only: repeated random tokens
(previous-token, duplicate-token, induction), real-text windows (sink rate, Sink^ε) and the same
windows with a random needle (retrieval). The math is in :mod:`tl_geometry.functional.head_scores`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ..functional import head_scores as _scores
from ..inputs.cache import PATTERN_HOOK
from ..inputs.text import text_windows
from ..inputs.tokens import check_token_ids

#: Sequences built when none are passed: random repeated sequences and text windows.
N_REPEATED, N_WINDOWS, WINDOW_LENGTH = 8, 8, 64


def head_scores(model: Any, *, repeated: Tensor | None = None, windows: Tensor | None = None,
                seed: int = 0):
    """Per (layer, head), the scores of SPEC §9 as a ``pandas.DataFrame``.

    Columns ``layer, head, previous_token, duplicate_token, induction, sink_rate, retrieval``;
    ``df.attrs["sink_epsilon"]`` is the model's Sink^ε (share of heads with ``sink_rate > 0.3``,
    Gu et al., ICLR 2025), ``df.attrs["epsilon"]`` the threshold and ``df.attrs["repeat"]`` R.

    Args:
        model: a TransformerLens model (``HookedTransformer`` or ``TransformerBridge``).
        repeated: ``[batch, 1 + 2R]`` token ids, BOS then ``R`` tokens repeated twice; default:
            8 sequences with ``R = 32`` drawn from ``seed`` uniformly over the vocabulary without
            special tokens, at the token level (no detokenise round trip).
        windows: ``[batch, 64]`` real-text token ids starting with BOS; default: 8 windows of the
            built-in sample text (:func:`tl_geometry.text_windows`). Read for ``sink_rate`` and,
            with a random 32-token needle inserted at the middle and its first 16 tokens repeated
            at the end, for ``retrieval``.
        seed: seeds the random tokens (repeated sequences and needles).

    Example:
        >>> scores = tl_geometry.head_scores(model)                        # doctest: +SKIP
        >>> scores.nlargest(3, "induction"), scores.attrs["sink_epsilon"]  # doctest: +SKIP
    """
    import pandas as pd

    cfg = model.cfg
    generator = torch.Generator().manual_seed(seed)
    vocabulary = ordinary_tokens(model)
    bos = _bos(model)
    if repeated is None:
        body = _draw(vocabulary, (N_REPEATED, _scores.REPEAT_LENGTH), generator)
        repeated = torch.cat([torch.full((N_REPEATED, 1), bos), body, body], dim=1)
    repeat = _check_repeated(repeated)
    check_token_ids(repeated, cfg.d_vocab, "repeated")
    if windows is None:
        windows = text_windows(model, n_seqs=N_WINDOWS, seq_len=WINDOW_LENGTH)
    _check_windows(windows, cfg.d_vocab)
    needles = _draw(vocabulary, (windows.shape[0], _scores.NEEDLE_LENGTH), generator)
    start, queries, keys = _scores.retrieval_layout(windows.shape[1])
    with_needle = torch.cat([windows[:, :start], needles, windows[:, start:],
                             needles[:, :_scores.NEEDLE_REPEATED]], dim=1)

    columns: dict[str, list[Tensor]] = {name: [] for name in _scores.SCORE_NAMES}
    for pattern in _patterns(model, repeated).values():
        columns["previous_token"].append(_scores.previous_token_score(pattern))
        columns["duplicate_token"].append(_scores.duplicate_token_score(pattern, repeat))
        columns["induction"].append(_scores.induction_score(pattern, repeat))
    for pattern in _patterns(model, windows).values():
        columns["sink_rate"].append(_scores.sink_rate(pattern))
    for pattern in _patterns(model, with_needle).values():
        columns["retrieval"].append(_scores.argmax_share(pattern, queries, keys))
    n_layers, n_heads = cfg.n_layers, cfg.n_heads
    frame = pd.DataFrame({
        "layer": torch.arange(n_layers).repeat_interleave(n_heads).numpy(),
        "head": torch.arange(n_heads).repeat(n_layers).numpy(),
        # Under a device map each layer's scores live on its own device: gather them on the CPU.
        **{name: torch.cat([v.cpu() for v in values]).numpy() for name, values in columns.items()},
    })
    frame.attrs.update(sink_epsilon=_scores.sink_epsilon(torch.cat([v.cpu() for v in columns["sink_rate"]])),
                       epsilon=_scores.SINK_EPSILON, repeat=repeat)
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


def _bos(model: Any) -> int:
    bos = getattr(getattr(model, "tokenizer", None), "bos_token_id", None)
    if bos is None:
        raise ValueError("the model's tokenizer has no BOS token; pass repeated= and windows= "
                         "token ids that start with the model's first (sink) token.")
    return int(bos)


def _check_repeated(repeated: Tensor) -> int:
    """``R`` of a ``[batch, 1 + 2R]`` repeated sequence; a clear error when it is not one."""
    if not isinstance(repeated, Tensor) or repeated.ndim != 2 or repeated.shape[1] < 5 or repeated.shape[1] % 2 != 1:
        shape = list(repeated.shape) if isinstance(repeated, Tensor) else type(repeated).__name__
        raise ValueError(f"repeated must be [batch, 1 + 2R] token ids (BOS + R tokens repeated "
                         f"twice, R ≥ 2), got {shape}.")
    repeat = (repeated.shape[1] - 1) // 2
    if not torch.equal(repeated[:, 1:repeat + 1], repeated[:, repeat + 1:]):
        raise ValueError("repeated's second half (after BOS) must equal its first: positions "
                         f"1..{repeat} and {repeat + 1}..{2 * repeat} hold the same tokens.")
    return repeat


def _check_windows(windows: Tensor, d_vocab: int) -> None:
    if not isinstance(windows, Tensor) or windows.ndim != 2 or windows.shape[1] < 4:
        shape = list(windows.shape) if isinstance(windows, Tensor) else type(windows).__name__
        raise ValueError(f"windows must be [batch, 64] real-text token ids starting with BOS, got {shape}; "
                         "tl_geometry.text_windows(model, n_seqs=8, seq_len=64) makes them.")
    if windows.is_floating_point() or int(windows.min()) < 0 or int(windows.max()) >= d_vocab:
        raise ValueError(f"windows must hold token ids in [0, {d_vocab}).")


def _patterns(model: Any, tokens: Tensor) -> dict[int, Tensor]:
    """``hook_pattern`` of every layer for ``tokens`` (only those hooks are cached)."""
    names = {PATTERN_HOOK.format(layer=layer): layer for layer in range(model.cfg.n_layers)}
    device = getattr(model.cfg, "device", None) or "cpu"
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens.to(device), names_filter=lambda name: name in names)
    return {layer: cache[name] for name, layer in names.items()}
