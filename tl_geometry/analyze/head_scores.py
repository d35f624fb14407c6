"""``head_scores``: the head scores other tools use, from a model's attention patterns (SPEC §9).

One forward pass per kind of sequence: repeated random tokens (previous-token, duplicate-token,
induction), real-text windows (sink rate, Sink^ε) and the same windows with a random needle
(retrieval), each layer scored inside the forward (:mod:`.score_weights`), which never computes
logits. The math is in :mod:`tl_geometry.functional.head_scores`.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import warnings
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

from ..engine.sink_choice import CANDIDATES, choose_sink, first_keys_mass
from ..functional import head_scores as _scores
from ..inputs.cache import PATTERN_HOOK, CacheError, first_few
from ..inputs.capture import capture_attention
from ..inputs.facts import ModelFacts, model_facts
from ..inputs.text import text_windows
from ..inputs.tokens import check_token_tensor
from . import sink as _sink
from .from_model import AttentionSource, recompute_possible
from .score_weights import CaptureWeights, PatternWeights
from .sink import Sink
from .stop import StopForward, forward_until_stopped

#: Sequences built when none are passed: random repeated sequences and text windows.
N_REPEATED, N_WINDOWS = 8, 8
#: The text windows' length when neither ``seq_len`` nor ``windows`` says: the analysis's own
#: default (``tl-geometry analyze --seq-len``), so that scores and labels read the same context.
DEFAULT_SEQ_LEN = 128
#: The shortest text window (BOS and three tokens); the shortest ``R``.
MIN_SEQ_LEN, MIN_REPEAT = 4, 2
#: Tokens a retrieval sequence adds to its text window: the needle and its repeated tokens.
RETRIEVAL_EXTRA = _scores.NEEDLE_LENGTH + _scores.NEEDLE_REPEATED
#: One layer's float32 pattern of one forward stays below this size (more sequences run in
#: batches). 32 MiB, not more: eager attention over larger batches is slower per sequence on CPU
#: (8 windows of 512 tokens on SmolLM2: 12.9 s against 15.3 s at 256 MiB).
PATTERN_BUDGET = 1 << 25
#: Tokens per forward of the capture path (its memory grows as tokens × width, not as ``T²``).
CAPTURE_TOKENS = 1 << 14
#: Seeds are whole numbers in ``[0, MAX_SEED)``.
MAX_SEED = 2**63

Weights = CaptureWeights | PatternWeights
Score = Callable[[Weights, int], Tensor]
T = TypeVar("T")


def head_scores(model: Any, *, seq_len: int | None = None, repeat: int | None = None,
                repeated: Tensor | None = None, windows: Tensor | None = None,
                sink_windows: Tensor | None = None, seed: int = 0, sink: Sink = None,
                attention: AttentionSource = "auto"):
    """Per (layer, head), the scores of SPEC §9 as a ``pandas.DataFrame``.

    Columns ``layer, head, previous_token, duplicate_token, induction, sink_rate, retrieval,
    sink_queries``. ``sink_rate`` is the mean weight on **key 0** (Gu et al.'s first-token
    definition) over the queries ``t ≥ 1`` of the text windows that see key 0, ``sink_queries``
    how many such queries a window has (``min(T, w) − 1``). ``attrs``: ``sink_epsilon`` (Sink^ε,
    Gu et al., ICLR 2025: the share of heads whose sink rate on windows of
    ``attrs["sink_epsilon_seq_len"]`` = 64 tokens is above ``attrs["epsilon"]`` = 0.3, whatever
    ``seq_len``), ``seq_len``, ``n_windows``, ``repeat``, ``window`` (each layer's sliding
    window; ``None`` for a model without any), ``trained_with_bos``, ``attention`` (the path the
    weights came from) and ``sink`` (the rule and each text window's sink position).

    Where the sink is not key 0 of every window (``sink="auto"``, the default for a model trained
    without BOS, or given positions), the column ``sink_rate_selected`` is the mean weight on each
    window's chosen sink over the queries after it that see it: labelled as selected, since
    choosing the most attended key biases it upward (SPEC §9); it costs one more forward.

    Sink^ε reads ``sink_windows`` where given, else 8 windows of 64 tokens of the same text
    where ``head_scores`` cuts the windows itself, else the first 64 tokens of the ``windows``
    passed; shorter windows leave it NaN, with a warning.

    Every sequence starts as the model was trained (:func:`tl_geometry.inputs.models.trained_with_bos`):
    with BOS for SmolLM2 and Gemma-3, with a text token for Qwen2.5-Coder. Sequences passed in
    that start otherwise, or that hold pad tokens, are refused with a ``ValueError``.

    Args:
        seq_len: tokens per text window, BOS included (``≥ 4``); default 128, the analysis's own
            default, or the length of ``windows`` where they are passed.
        repeat: ``R``, the random tokens repeated twice for previous_token, duplicate_token and
            induction: ``≥ 2``, default 32, at most ``w − 1`` on sliding-window layers (Gemma-3:
            511); or the ``R`` of ``repeated`` where it is passed.
        repeated: ``[batch, 2R]`` token ids (``[batch, 1 + 2R]`` after BOS); default: 8
            sequences drawn from ``seed`` uniformly over the vocabulary without special tokens.
        windows: ``[batch, T]`` real-text token ids (``T ≥ 4``), without padding; default: 8
            windows of ``seq_len`` tokens of the sample text (:func:`tl_geometry.text_windows`).
            Read for ``sink_rate`` and, with a random 32-token needle inserted at the middle and
            its first 16 tokens repeated at the end, for ``retrieval``.
        sink_windows: ``[batch, 64]`` real-text token ids for Sink^ε (checked as ``windows``).
        seed: seeds the random tokens; a whole number in ``[0, 2**63)``.
        sink: the text windows' sink (SPEC §1), as :func:`tl_geometry.analyze_heads` takes it,
            checked against the windows before any forward.
        attention: as :func:`tl_geometry.analyze_model` takes it (only the weights the scores
            read are recomputed: :mod:`tl_geometry.analyze.score_weights`), but ``"auto"``
            (default, ours) recomputes wherever the model can, since a mean of weights does not
            move at float32 round-off and the eager forward holds ``[batch, head, T, T]``.

    Example:
        >>> scores = tl_geometry.head_scores(model, seq_len=128)           # doctest: +SKIP
        >>> scores.nlargest(3, "induction"), scores.attrs["sink_epsilon"]  # doctest: +SKIP
    """
    import pandas as pd

    facts = _check_model(model)  # read once: nothing below changes what the model says of itself
    n_layers, n_heads = facts.shape()
    seed = _check_seed(seed)
    recompute = recompute_possible(attention, model)  # "auto": wherever the model can (ours)
    _sink.check(sink)  # its positions against the windows once they are known, before any forward
    layer_window = facts.layer_windows(n_layers)
    n_ctx = getattr(model.cfg, "n_ctx", None)
    n_ctx = n_ctx if isinstance(n_ctx, int) and not isinstance(n_ctx, bool) and n_ctx > 0 else None
    # Without windows, text_windows asks (and warns where nothing says) itself.
    with_bos = facts.trained_with_bos(warn=windows is not None)
    start = 1 if with_bos else 0
    chosen = _sink.rule(sink, None, bos_prepended=with_bos)
    # Every argument is checked before the first forward.
    if seq_len is not None:
        seq_len = _check_length(seq_len, "seq_len", MIN_SEQ_LEN, "tokens per text window, BOS included")
    if repeat is not None:
        repeat = _check_length(repeat, "repeat", MIN_REPEAT, "R, the random tokens repeated twice")
    if repeated is not None:
        given = _check_repeated(repeated, facts.d_vocab, start)
        if repeat is not None and repeat != given:
            raise ValueError(f"repeat={repeat} but repeated holds R = {given} tokens repeated twice "
                             f"(shape {list(repeated.shape)}); pass one of them, or both alike.")
        repeat = given
    repeat = _scores.REPEAT_LENGTH if repeat is None else repeat
    _check_repeat_fits(facts.name, repeat, start, layer_window, n_ctx)
    if windows is not None:
        _check_windows(windows, facts.d_vocab)
        if seq_len is not None and seq_len != windows.shape[1]:
            raise ValueError(f"seq_len={seq_len} but windows are {windows.shape[1]} tokens long "
                             f"(shape {list(windows.shape)}); pass one of them, or both alike.")
    length = windows.shape[1] if windows is not None else seq_len or DEFAULT_SEQ_LEN
    if n_ctx is not None and length + RETRIEVAL_EXTRA > n_ctx:
        raise ValueError(f"text windows of {length} tokens make retrieval sequences of {length} + "
                         f"{RETRIEVAL_EXTRA} tokens (the needle and its repeat), beyond "
                         f"{facts.name}'s context of {n_ctx}; use seq_len ≤ {n_ctx - RETRIEVAL_EXTRA}.")
    if sink_windows is not None:
        _check_windows(sink_windows, facts.d_vocab, "sink_windows")
        if sink_windows.shape[1] != _scores.SINK_EPSILON_LENGTH:
            raise ValueError(f"sink_windows must be [batch, {_scores.SINK_EPSILON_LENGTH}] (Sink^ε reads "
                             f"windows of {_scores.SINK_EPSILON_LENGTH} tokens), got "
                             f"{list(sink_windows.shape)}.")

    generator = torch.Generator().manual_seed(seed)
    vocabulary = ordinary_tokens(model)
    if repeated is None:
        body = _draw(vocabulary, (N_REPEATED, repeat), generator)
        first = [torch.full((N_REPEATED, 1), facts.bos_token())] if with_bos else []
        repeated = torch.cat([*first, body, body], dim=1)
    built = windows is None
    if windows is None:
        windows = text_windows(model, n_seqs=N_WINDOWS, seq_len=length)
    if sink_windows is None and built and length != _scores.SINK_EPSILON_LENGTH:
        # The same 64-token windows whatever seq_len: Sink^ε does not move with it.
        sink_windows = text_windows(model, n_seqs=N_WINDOWS, seq_len=_scores.SINK_EPSILON_LENGTH)
    for name, tokens in (("repeated", repeated), ("windows", windows), ("sink_windows", sink_windows)):
        if tokens is not None:
            _check_sequences(model, tokens, name, with_bos)
    if chosen != _sink.AUTO:  # the given sinks against the text windows, before the first forward
        _sink.positions(chosen, torch.ones(windows.shape, dtype=torch.bool), 0, int(windows.shape[0]))
    needles = _draw(vocabulary, (windows.shape[0], _scores.NEEDLE_LENGTH), generator)
    middle, queries, keys = _scores.retrieval_layout(length)
    with_needle = torch.cat([windows[:, :middle], needles, windows[:, middle:],
                             needles[:, :_scores.NEEDLE_REPEATED]], dim=1)

    def sink_rate(w: Weights, layer: int, n_pos: int | None = None) -> Tensor:
        return w.mean_weight(*_scores.sink_pairs(n_pos or w.n_pos, w.device), layer_window[layer])

    def sink_64(w: Weights, layer: int) -> Tensor:
        return sink_rate(w, layer, _scores.SINK_EPSILON_LENGTH)  # causal: the prefix's own weights

    text_scores: dict[str, Score] = {"sink_rate": sink_rate}
    if sink_windows is None and length >= _scores.SINK_EPSILON_LENGTH:
        text_scores["sink_64"] = sink_64  # the 64-token prefixes, read in the same forward

    def repeated_score(pairs: Callable[..., tuple[Tensor, Tensor]], *args: int) -> Score:
        return lambda w, layer: w.mean_weight(*pairs(w.n_pos, *args, start, w.device), layer_window[layer])

    means = functools.partial(_layer_means, model, recompute=recompute)
    columns = {
        **means(repeated, {
            "previous_token": repeated_score(_scores.previous_token_pairs),
            "duplicate_token": repeated_score(_scores.second_copy_pairs, repeat, 0),
            "induction": repeated_score(_scores.second_copy_pairs, repeat, 1),
        }),
        **means(windows, text_scores),
        **(means(sink_windows, {"sink_64": sink_64}) if sink_windows is not None else {}),
        **means(with_needle, {"retrieval": lambda w, layer: w.argmax_share(
            queries.to(w.device), keys.to(w.device), layer_window[layer])}),
    }
    if "sink_64" in columns:
        epsilon = _scores.sink_epsilon(torch.cat([v.cpu() for v in columns["sink_64"]]))
    else:
        epsilon = float("nan")
        warnings.warn(f"Sink^ε reads windows of {_scores.SINK_EPSILON_LENGTH} tokens (Gu et al.) and "
                      f"these windows have {length}: attrs['sink_epsilon'] is NaN. Pass sink_windows= "
                      f"({_scores.SINK_EPSILON_LENGTH}-token windows of the same text, e.g. "
                      f"tl_geometry.text_windows(model, text, seq_len={_scores.SINK_EPSILON_LENGTH})) "
                      "or windows of at least that length.", UserWarning, stacklevel=2)
    selected, positions = (None, [0] * int(windows.shape[0])) if chosen == [0] else _selected_sink_rates(
        model, windows, chosen, layer_window, recompute)
    sink_counts = torch.tensor([_scores.sink_queries(length, w) for w in layer_window])
    frame = pd.DataFrame({
        "layer": torch.arange(n_layers).repeat_interleave(n_heads).numpy(),
        "head": torch.arange(n_heads).repeat(n_layers).numpy(),
        # Under a device map each layer's scores live on its own device: gather them on the CPU.
        **{name: torch.cat([v.cpu() for v in columns[name]]).numpy() for name in _scores.SCORE_NAMES},
        "sink_queries": sink_counts.repeat_interleave(n_heads).numpy(),
        **({"sink_rate_selected": torch.cat([v.cpu() for v in selected]).numpy()} if selected is not None else {}),
    })
    frame.attrs.update(sink_epsilon=epsilon, sink_epsilon_seq_len=_scores.SINK_EPSILON_LENGTH,
                       epsilon=_scores.SINK_EPSILON, seq_len=length, n_windows=int(windows.shape[0]),
                       repeat=repeat, window=None if not any(layer_window) else list(layer_window),
                       trained_with_bos=with_bos, attention="recompute" if recompute else "pattern",
                       sink={"rule": _sink.AUTO if chosen == _sink.AUTO else "given", "positions": positions})
    return frame


def _selected_sink_rates(model: Any, windows: Tensor, chosen: str | list[int],
                         layer_window: Sequence[int | None], recompute: bool) -> tuple[list[Tensor], list[int]]:
    """Per layer, the mean weight ``α[t, p]`` on each window's sink ``p`` over the queries
    ``t > p`` that see it (per head, mean over windows); and the positions. ``"auto"`` chooses
    ``p`` per window from the same forward (:func:`tl_geometry.engine.sink_choice.choose_sink`)."""
    n_seqs, n_pos = windows.shape
    auto = chosen == _sink.AUTO
    # "auto" chooses from every layer, so only after the forward: until then each layer keeps
    # the rate of every candidate (choose_sink picks one of the first 32 keys).
    given = [] if auto else _sink.positions(chosen, torch.ones(windows.shape, dtype=torch.bool), 0, n_seqs).tolist()
    keys = [range(min(CANDIDATES, n_pos))] * n_seqs if auto else [[p] for p in given]

    def read(lo: int, w: Weights, layer: int) -> tuple[Tensor | None, list[list[Tensor]]]:
        window = layer_window[layer]
        is_token = torch.ones(w.batch, n_pos, dtype=torch.bool, device=w.device)
        mass = first_keys_mass(w.rows(), is_token, window).cpu() if auto else None
        # Each window's candidates (or its given sink) as columns: key p is column j.
        wanted = sorted({p for b in range(len(is_token)) for p in keys[lo + b]})
        columns, column = w.key_columns(wanted), {p: j for j, p in enumerate(wanted)}
        return mass, [[columns[b:b + 1, :, _after(p, n_pos, window, w.device), column[p]].double().mean(dim=(0, 2))
                       for p in keys[lo + b]] for b in range(len(is_token))]

    per_window: list[list[Tensor]] = [[] for _ in layer_window]
    positions: list[int] = []
    batch = _batch_size(model, n_seqs, n_pos, recompute)
    for lo in range(0, n_seqs, batch):
        masses, rates = zip(*_each_layer(model, windows[lo:lo + batch], functools.partial(read, lo), recompute))
        sinks = choose_sink(masses).tolist() if auto else given[lo:lo + batch]
        positions += [int(p) for p in sinks]
        for layer, per_key in enumerate(rates):
            per_window[layer].extend(rate[p if auto else 0] for rate, p in zip(per_key, sinks))
    return [torch.stack(layer_rates).nanmean(0) for layer_rates in per_window], positions


def _after(p: int, n_pos: int, window: int | None, device: Any) -> Tensor:
    """The queries ``t > p`` that see key ``p``."""
    t = torch.arange(p + 1, n_pos, device=device)
    return t[_scores.visible(t, torch.full_like(t, p), window)]


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


def _check_model(model: Any) -> ModelFacts:
    """The facts of a TransformerLens model (hooks and sizes); a clear error for anything else."""
    facts = model_facts(model)
    if not callable(getattr(model, "hooks", None)) or None in (facts.n_layers, facts.n_heads, facts.d_vocab):
        got = "None" if model is None else type(model).__name__
        raise ValueError(f"head_scores needs a TransformerLens model (a TransformerBridge from "
                         f"tl_geometry.load_model, or a HookedTransformer) with hooks() and "
                         f"cfg.n_layers, cfg.n_heads, cfg.d_vocab; got {got}.")
    return facts


def _check_seed(seed: Any) -> int:
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise ValueError(f"seed must be a whole number in [0, 2**63), got {seed!r} "
                         f"({type(seed).__name__}); e.g. seed=0.")
    if not 0 <= int(seed) < MAX_SEED:
        raise ValueError(f"seed must be in [0, 2**63) (a 64-bit generator seed), got {int(seed)}; "
                         "pick a smaller whole number, e.g. seed=0.")
    return int(seed)


def _check_length(value: Any, name: str, least: int, what: str) -> int:
    """A whole number ``≥ least`` (not a bool): ``seq_len`` and ``repeat``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name} must be a whole number ≥ {least} ({what}), got {value!r} "
                         f"({type(value).__name__}).")
    if value < least:
        why = " (with R = 1 the induction key is the query itself)" if name == "repeat" else ""
        raise ValueError(f"{name} must be ≥ {least} ({what}){why}, got {int(value)}.")
    return int(value)


def _check_repeat_fits(model_name: str, repeat: int, start: int, layer_window: list[int | None],
                       n_ctx: int | None) -> None:
    """``R ≤ w − 1`` on every sliding-window layer (the second copy's query ``t`` then sees its
    earlier occurrence ``t − R``), and the repeated sequence within the model's context."""
    local = [(w, layer) for layer, w in enumerate(layer_window) if w is not None]
    if local:
        w, layer = min(local)
        if repeat > w - 1:
            raise ValueError(f"repeat R = {repeat} is too long for {model_name}'s sliding-window "
                             f"layers (layer {layer} sees the last {w} keys): a query of the second "
                             f"copy sees its token's earlier occurrence only for R ≤ w − 1 = {w - 1}; "
                             f"use repeat ≤ {w - 1}.")
    if n_ctx is not None and start + 2 * repeat > n_ctx:
        layout = "BOS + 2R" if start else "2R"
        raise ValueError(f"repeat R = {repeat} makes sequences of {start + 2 * repeat} tokens "
                         f"({layout}), beyond {model_name}'s context of {n_ctx}; use repeat ≤ "
                         f"{(n_ctx - start) // 2}.")


def _check_repeated(repeated: Any, d_vocab: int | None, start: int) -> int:
    """``R`` of a repeated sequence (``[batch, start + 2R]``); a clear error when it is not one."""
    layout = ("[batch, 1 + 2R] token ids (BOS + R tokens repeated twice, R ≥ 2)" if start
              else "[batch, 2R] token ids (R tokens repeated twice, R ≥ 2, no BOS: the model was "
                   "trained without one)")
    check_token_tensor(repeated, "repeated", d_vocab, min_pos=start + 2 * MIN_REPEAT, layout=layout)
    length = repeated.shape[1] - start
    if length % 2:
        raise ValueError(f"repeated must be {layout}, got {list(repeated.shape)}.")
    repeat = length // 2
    first, second = repeated[:, start:start + repeat], repeated[:, start + repeat:]
    if not torch.equal(first, second):
        after = " (after BOS)" if start else ""
        raise ValueError(f"repeated's second half{after} must equal its first: positions "
                         f"{start}..{start + repeat - 1} and {start + repeat}..{start + 2 * repeat - 1} "
                         "hold the same tokens.")
    return repeat


def _check_windows(windows: Any, d_vocab: int | None, name: str = "windows") -> None:
    layout = ("[batch, T] real-text token ids (T ≥ 4) starting as the model was trained; "
              "tl_geometry.text_windows(model, n_seqs=8, seq_len=128) makes them")
    check_token_tensor(windows, name, d_vocab, min_pos=MIN_SEQ_LEN, layout=layout)


def _rows(mask: Tensor) -> str:
    return first_few(mask.nonzero().flatten().tolist())


def _check_sequences(model: Any, tokens: Tensor, name: str, with_bos: bool) -> None:
    """Sequences start with BOS where the model was trained with one, and never where it was not
    (SPEC §1: the first key is the sink either way), and hold no pad token (every position is
    read as text): a dedicated pad id anywhere, or a run of a pad id that doubles as BOS or EOS
    (a document separator where it stands alone)."""
    facts = model_facts(model)
    bos = facts.bos_id
    first = tokens[:, 0].cpu()
    fix = ("build them with tl_geometry.text_windows(model, text, n_seqs=..., seq_len=...), which "
           "starts each window as the model was trained")
    if bos is not None and with_bos and (first != bos).any():
        raise ValueError(f"{name}: sequence(s) {_rows(first != bos)} do not start with BOS (id {bos}), "
                         f"but {facts.name} was trained with BOS at the start of a sequence; put "
                         f"BOS first, or {fix}.")
    if bos is not None and not with_bos and (first == bos).any():
        raise ValueError(f"{name}: sequence(s) {_rows(first == bos)} start with the tokenizer's BOS "
                         f"(id {bos}), but {facts.name} was trained without BOS at the start of a "
                         f"sequence (its first text token is the sink); drop that token "
                         f"(tokens[:, 1:]), or {fix}.")
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


def _special_ids(tokenizer: Any, *names: str) -> set[int]:
    ids = (getattr(tokenizer, name, None) for name in names)
    return {int(i) for i in ids if isinstance(i, int) and not isinstance(i, bool)}


def _batch_size(model: Any, n_seqs: int, n_pos: int, recompute: bool) -> int:
    """Sequences per forward (at least one) within :data:`PATTERN_BUDGET` (pattern) or
    :data:`CAPTURE_TOKENS` (capture)."""
    fit = CAPTURE_TOKENS // n_pos if recompute else PATTERN_BUDGET // (model.cfg.n_heads * n_pos * n_pos * 4)
    return max(1, min(n_seqs, fit))


def _layer_means(model: Any, tokens: Tensor, scores: dict[str, Score], recompute: bool) -> dict[str, list[Tensor]]:
    """Per score and layer, its per-head mean over every sequence of ``tokens`` (each score called
    with a layer's weights and index), in batches (:func:`_batch_size`) weighted by size."""
    n_seqs, n_pos = tokens.shape
    batch = _batch_size(model, n_seqs, n_pos, recompute)
    parts: dict[str, list[list[Tensor]]] = {name: [[] for _ in range(model.cfg.n_layers)] for name in scores}
    for lo in range(0, n_seqs, batch):
        chunk = tokens[lo:lo + batch]
        per_layer = _each_layer(model, chunk, lambda weights, layer: {
            name: score(weights, layer) for name, score in scores.items()}, recompute)
        for layer, values in enumerate(per_layer):
            for name, value in values.items():
                parts[name][layer].append(value * (len(chunk) / n_seqs))
    return {name: [torch.stack(values).sum(0) for values in layers] for name, layers in parts.items()}


def _each_layer(model: Any, tokens: Tensor, read: Callable[[Weights, int], T], recompute: bool) -> list[T]:
    """``read(weights, layer)`` of each layer for ``tokens``, in layer order (:func:`_forward`)."""
    n_layers = model.cfg.n_layers
    out: list[tuple[int, T]] = []

    def on_layer(weights: Weights, layer: int) -> None:
        out.append((layer, read(weights, layer)))
        if layer == n_layers - 1:
            raise StopForward

    _forward(model, tokens, recompute, on_layer)
    fired = [layer for layer, _ in out]
    if fired != list(range(n_layers)):
        ran, how = (("ran attention", "the capture of transformers' attention functions") if recompute
                    else ("fired hook_pattern", "TransformerLens hooks on eager attention"))
        raise CacheError(f"{model_facts(model).name}'s forward {ran} on layers {fired}, not once on each of "
                         f"0..{n_layers - 1} in order: head_scores reads every layer's attention "
                         f"weights ({how}).")
    return [value for _, value in out]


def _forward(model: Any, tokens: Tensor, recompute: bool, on_layer: Callable[[Weights, int], None]) -> None:
    """One forward of ``tokens`` without logits, calling ``on_layer(weights, layer)`` as each
    layer's attention runs (from its capture or its ``hook_pattern``), up to the
    :class:`~tl_geometry.analyze.stop.StopForward` it raises."""
    if recompute:
        with contextlib.suppress(StopForward):
            capture_attention(model, tokens, lambda c: on_layer(CaptureWeights(c), c.layer), logsumexp=True)
        return
    hooks = [(PATTERN_HOOK.format(layer=layer),
              functools.partial(lambda layer, pattern, hook=None: on_layer(PatternWeights(pattern), layer), layer))
             for layer in range(model.cfg.n_layers)]
    with torch.no_grad(), model.hooks(fwd_hooks=hooks):
        forward_until_stopped(model, tokens.to(getattr(model.cfg, "device", None) or "cpu"), return_type=None)
