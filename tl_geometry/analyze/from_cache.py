"""``analyze_heads``: a thin front-end that feeds a cache, layer by layer, to the engine
(:func:`engine.analyze_layer` → :class:`engine.Accumulator` → :class:`HeadAnalysis`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor
from typing_extensions import Unpack

from ..engine import (
    DEFAULT_N_VALUES,
    Accumulator,
    analyze_layer,
    check_options,
    output_weights,
    run_metadata,
)
from ..engine.block import PatternRows
from ..engine.options import AnalysisArgs, check_option_names, check_query_positions
from ..inputs import cache as _cache
from ..inputs.facts import model_facts
from ..progress import progress_bar
from ..result import HeadAnalysis
from . import local_sink as _local
from . import sink as _sink
from . import windows as _windows
from .sink import Sink
from .windows import Window

__all__ = ["DEFAULT_N_VALUES", "analyze_heads"]


def analyze_heads(
    cache: Any,
    *,
    attention_mask: Tensor | None = None,
    layers: Sequence[int] | None = None,
    model: Any = None,
    W_O: Tensor | None = None,
    tokens: Tensor | None = None,
    progress: bool | None = None,
    window: Window = "auto",
    sink: Sink = None,
    **options: Unpack[AnalysisArgs],
) -> HeadAnalysis:
    """Geometric separability, sink diagnostics and taxonomy of every head in a cache.

    Per (layer, head, N) it averages precision, recall, F, margin, inversions and the
    chance-corrected P* and F* (SPEC §3) of the top-N set, of ``random_samples`` nested random
    subsets, of the value-shuffle null, of the top-N re-selected without the sink, and of the
    top-N instances with the sink inside and outside the set, with the paired sink effect. Per
    (layer, head): the sink diagnostics (SPEC §4) and the source-winner taxonomy (SPEC §5; on a
    sliding-window layer from the queries that see the sink, the others in ``beyond_votes``).
    Per (sequence, sliding-window layer, head): the local sink (ours,
    :meth:`HeadAnalysis.local_sinks`). It runs on the cache's device (numba kernels on CPU,
    torch elsewhere).

    Args:
        cache: a TransformerLens ``ActivationCache`` (2.x, 3.x or 4.x) or a ``dict`` holding
            ``blocks.{l}.attn.hook_pattern`` ``[batch, head, query, key]`` and
            ``blocks.{l}.attn.hook_v`` ``[batch, pos, kv_head, d_head]`` of every analysed layer,
            read by exact name; make it with ``names_filter=tl_geometry.CACHE_NAMES_FILTER``.
        attention_mask: ``[batch, pos]``, 1 for real tokens: required for padded batches (left
            or right), and the forward pass must have been run with the same mask.
        layers: layer indices to analyse (default: every layer in the cache).
        model: optional model, read for ``W_O``, for the tokenizer's pad token (with
            ``tokens``) and for the run's metadata (name, weight processing).
        W_O: ``[layer, head, d_head, d_model]`` output projections for ``space="output"``.
        tokens: the ``[batch, pos]`` token ids the cache was made from; with ``model`` and no
            ``attention_mask``, pad tokens at the ends of sequences raise a warning. They also
            name each local sink's token (without them it is NaN).
        progress: progress over layers (:func:`tl_geometry.progress.progress_bar`): ``None``
            (default) a bar where one is visible; ``True`` also plain lines elsewhere.
        window: sliding windows (SPEC §1, ours): query ``t`` of a layer with window ``w`` sees
            keys ``t − w < i ≤ t``, and only those are candidates; a query whose window starts
            after the sink has no sink. ``None`` (no window), an int (every layer), a sequence
            indexed by model layer or a dict ``{layer: window}`` (``None`` and unnamed layers
            are global), or ``"auto"`` (default): the windows of ``model``'s config, every layer
            global without ``model``. Recorded as ``metadata["window"]``; a pattern with weight
            outside its declared window is an error.
        sink: which key of each sequence is the sink (SPEC §1): ``None`` (default) the first
            real token, or ``"auto"`` where ``model`` is known to have been trained without
            BOS (Qwen2/2.5); an int ``p`` (the ``p``-th real token of every sequence) or one int
            per sequence; ``"auto"``: per sequence, the most attended of its first 32 real
            tokens over every head and every layer the cache holds, whatever ``layers=``
            analyses. Keys before the sink are ordinary keys. The rule, positions, layers read
            and the sink check are recorded as ``metadata["sink"]``; a sink that is not the
            most attended in most layers warns "weak sink".

    Other Parameters:
        n_values (Sequence[int]): selection sizes N (default ``(1, 2, 4, 8, 16, 32, 64)``). A size
            that a query cannot hold (``N ≥ t + 1``) gives NaN for that query, never a smaller N.
        queries (str | int | Sequence[int]): ``"last"`` (default) — each sequence's last real query
            (the paper's protocol); ``"all"`` — every real query; an int ``k`` — ``k`` positions per
            sequence drawn from its real ones, seeded by ``seed`` and the sequence's index; a list of
            positions counted from each sequence's first real token (positions that no sequence
            holds are named in a warning). The votes read every query whatever it is.
        random_samples (int): random permutations per (query, head) for the baseline; default SPEC
            §3's ``R``: 16 where one query per sequence is read (the last), 4 where more are; 0
            turns the baseline off (its metrics are NaN).
        shuffle_samples (int): permutations per (query, head) for the null of the ``shuffled`` group
            (same α, same top-N set, the non-sink keys' values permuted); default the baseline's
            ``R`` (SPEC §3: every null uses it); 0 turns it off.
        shuffle (str): which null the ``shuffled`` group is (SPEC §3): ``"values"`` (default)
            permutes the non-sink values; ``"norms"`` only their norms; ``"directions"`` only their
            directions; ``"unselected"`` only the values outside ``S_N``. With one seed the four
            decompose the net effect (:func:`tl_geometry.result.null_decomposition`).
        seed (int): seed of the random baseline and the shuffle (default 0); the same seed gives the
            same numbers, whatever the batch size, chunking, device or front-end.
        distance (str): ``"euclidean"`` (default) or ``"cosine"``.
        space (str): ``"value"`` (``y = α·v``, default) or ``"output"`` (``y = α·v·W_O[h]``; needs
            ``model`` or ``W_O``).
        rank_by (str): rank keys for the top-N set by ``"attention"`` (α, default) or
            ``"contribution"`` (α‖v‖), SPEC §2's variant.
        bounds (bool): also compute, per (layer, head, N), the inversion certificates, the certified
            regime bounds, the predicted envelope and the shell certificate (K = 0 and K = N) of the
            top-N sets, and the regime diagnostics per head (SPEC §6; Euclidean; default False).
        backend (str): ``"auto"`` (default: numba on CPU, torch elsewhere), ``"numba"`` or
            ``"torch"``.
        per_window (bool): also keep each sequence's own means (``window_scores``,
            ``window_sink``, ``window_bounds``), which a bootstrap over windows resamples (SPEC §8);
            default False.

    These options are :class:`~tl_geometry.engine.options.AnalysisArgs`, the same keywords for
    :func:`analyze_model` and :func:`analyze_model_nulls`.

    Examples:
        >>> _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
        >>> result = tl_geometry.analyze_heads(cache, n_values=(1, 2, 4, 8))  # doctest: +SKIP
        >>> print(result.summary())  # doctest: +SKIP
    """
    check_option_names(options, "analyze_heads")
    opts = check_options(**options)
    _windows.check(window)
    chosen = _sink.rule(sink, model)
    layer_ids = _cache.resolve_layers(cache, layers)  # never empty
    layer_windows = _windows.resolve(window, model, layer_ids, need_model=False)
    W = output_weights(model, W_O, layer_ids) if opts.space == "output" else None
    # The first layer fixes every later one's shape, the mask and the accumulator.
    first, _ = _cache.read_layer(cache, layer_ids[0], upcast=False)
    batch, n_heads, n_pos = shape = tuple(first.shape[:3])
    mask = _cache.check_attention_mask(attention_mask, batch, n_pos, device=first.device)
    if attention_mask is None:
        _cache.warn_pad_tokens(tokens, model, (batch, n_heads, n_pos))
    acc = Accumulator.zeros(len(layer_ids), n_heads, len(opts.n_values), device=first.device,
                            n_sequences=batch, per_window=opts.per_window)
    sink_run = _sink.SinkRun(chosen, len(layer_ids), batch)
    check_query_positions(opts.queries, mask.sum(-1).tolist())
    sinks = None if sink_run.auto else sink_run.given(mask)
    for li, layer in enumerate(layer_ids):
        pattern = first if li == 0 else _cache.read_layer(cache, layer, upcast=False)[0]
        if tuple(pattern.shape[:3]) != shape:
            raise _cache.CacheError(
                f"Layer {layer}'s pattern is {tuple(pattern.shape)} but an earlier layer's was "
                f"[{batch}, {n_heads}, {n_pos}, {n_pos}]: the layers of one cache must agree."
            )
        if sink_run.auto:  # the sinks are chosen from every layer before any is analysed
            sink_run.probe(layer, li, PatternRows(pattern), mask, layer_windows[li])
    if sinks is None:
        # "auto" also reads every other layer the cache holds (SPEC §1), except one that cannot
        # be read alike (a missing hook, another shape).
        cached = _cache.cached_layers(cache)
        for layer, layer_window in _sink.choice_layers(window, model, layer_ids, cached,
                                                       need_model=False).items():
            try:
                pattern, _ = _cache.read_layer(cache, layer, upcast=False)
            except (_cache.CacheError, KeyError):
                continue
            if pattern.shape[0] == batch and pattern.shape[2] == n_pos:
                sink_run.probe(layer, None, PatternRows(pattern), mask, layer_window)
        sinks = sink_run.choose(mask)
    tokens = _cache.check_cache_tokens(tokens, batch, n_pos)
    local = _local.LocalSinks(layer_windows, batch)
    stats = []  # added at once: one operation per statistic for every layer
    for li, layer in enumerate(progress_bar(layer_ids, progress, "analyze_heads", "layer")):
        pattern, v = _cache.read_layer(cache, layer, upcast=False)
        W_layer = None if W is None else W[layer].to(pattern.device)
        layer_window = layer_windows[li]
        stats.append(analyze_layer(pattern, v, mask, sinks, opts, layer=layer, W_O=W_layer,
                                   mask_given=attention_mask is not None, window=layer_window))
        if not sink_run.auto:  # given sinks: checked on the rows the analysis has just read
            sink_run.probe(layer, li, PatternRows(pattern), mask, layer_window, sinks,
                           stats[-1].first_keys)
        if layer_window is not None:  # after the engine has checked the pattern against the window
            local.add(li, 0, _local.layer_local_sink(pattern, v, mask, sinks, layer_window, tokens))
    acc.add_layers(range(len(layer_ids)), stats)
    facts = model_facts(model)
    metadata = run_metadata(model, cache, (batch, n_heads, n_pos), opts, attention_mask is not None,
                            facts=None if model is None else facts)
    metadata["n_kv_heads"] = int(v.shape[2])  # the unit of value-only figures (SPEC §4)
    metadata["sink"] = sink_run.record(model, n_layers=facts.n_layers)
    return local.attach(acc.finish(layer_ids, opts, n_pos, metadata, layer_windows))
