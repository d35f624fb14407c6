"""``analyze_model``: the analysis computed inside the forward pass, one layer at a time.

Hooks on ``hook_v`` and ``hook_pattern`` (or the capture of the recompute path) hand each layer
of each batch to the engine, whose statistics add into one
:class:`tl_geometry.engine.Accumulator`: no cache is built. Under ``torch.distributed`` every
rank analyses its shard of the sequences and the accumulators are all-reduced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch
from torch import Tensor
from typing_extensions import Unpack

from ..engine import (
    Accumulator,
    AnalysisOptions,
    analyze_layer,
    check_options,
    output_weights,
    run_metadata,
)
from ..engine.block import PatternRows
from ..engine.options import AnalysisArgs, check_option_names, check_query_positions, n_chosen
from ..engine.votes import n_blocks
from ..inputs import cache as _cache
from ..inputs import tokens as _tokens
from ..inputs.capture import LayerCapture, capture_attention
from ..inputs.facts import model_facts
from ..progress import check_progress, progress_counter
from ..result import HeadAnalysis
from ..result.schema import SHUFFLE_KINDS
from . import local_sink as _local
from . import sink as _sink
from . import windows as _windows
from .recompute import RecomputedRows, pattern_bytes
from .sink import Sink
from .stash import CaptureStash
from .stop import StopForward, forward_until_stopped
from .windows import Window

#: With ``attention="auto"``, one layer's pattern for one batch above this size is recomputed.
AUTO_RECOMPUTE_BYTES = 1 << 30
AttentionSource = Literal["auto", "pattern", "recompute"]
ATTENTION_SOURCES: tuple[str, ...] = get_args(AttentionSource)


def _as_tokens(model: Any, inputs: Any,
               attention_mask: Tensor | None) -> tuple[Tensor, Tensor | None, bool | None]:
    """Token ids ``[batch, pos]`` and mask from a tensor, a text, or a list of texts, and whether
    BOS was prepended here (``None`` for the caller's tokens)."""
    if isinstance(inputs, Tensor):
        if inputs.ndim != 2 or inputs.dtype not in (torch.long, torch.int, torch.int32, torch.int64):
            raise ValueError(f"inputs must be [batch, pos] token ids, got {tuple(inputs.shape)} {inputs.dtype}.")
        return inputs, attention_mask, None
    if isinstance(inputs, str):
        inputs = [inputs]
    if isinstance(inputs, Sequence) and inputs and all(isinstance(t, str) for t in inputs):
        if attention_mask is not None:
            raise ValueError("attention_mask is only for token inputs; texts are padded here.")
        tokenizer = model.tokenizer
        # Each text alone, unpadded: the padding is done below, on the right whatever the
        # tokenizer's padding_side, and the caller's tokenizer is left as it was.
        rows = [list(ids) for ids in tokenizer(list(inputs), add_special_tokens=False)["input_ids"]]
        empty = [i for i, ids in enumerate(rows) if not ids]
        if empty:
            raise ValueError(f"texts {empty[:8]} hold no token: drop the empty texts.")
        bos = model_facts(model).bos_to_prepend()  # BOS first only where the model was trained with it (SPEC §1)
        if bos is not None:
            rows = [[bos, *ids] for ids in rows]
        n_pos = max(len(ids) for ids in rows)
        pad = next((i for i in (getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None))
                    if i is not None), 0)  # any id: padded positions are masked everywhere
        tokens = torch.full((len(rows), n_pos), pad, dtype=torch.long)
        mask = torch.zeros(len(rows), n_pos, dtype=torch.long)
        for b, ids in enumerate(rows):
            tokens[b, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[b, :len(ids)] = 1
        return tokens, mask, bos is not None
    raise ValueError("inputs must be a [batch, pos] token tensor, a text, or a list of texts.")


class _LayerHooks:
    """Forward hooks that hand each layer's (pattern, v) to the engine as soon as both fired,
    once per analysis in ``runs`` (accumulator, options): one forward serves them all."""

    def __init__(self, runs: Sequence[tuple[Accumulator, AnalysisOptions]], layer_ids: list[int],
                 W: Tensor | None, mask_given: bool, windows: Sequence[int | None],
                 from_config: bool, sink: str | list[int], n_windows: int,
                 choice: dict[int, int | None]) -> None:
        self.runs, self.W, self.mask_given = list(runs), W, mask_given
        self.row = {layer: i for i, layer in enumerate(layer_ids)}
        self.windows = list(windows)
        self.from_config = from_config  # the windows came from the config: the capture must agree
        self.pending: dict[int, dict[str, Tensor]] = {}
        # The batch's mask, offset, tokens and sinks (None while sink='auto' probes), set per batch.
        self.mask = torch.zeros(0, 0, dtype=torch.bool)
        self.sink: Tensor | None = None
        self.offset = 0
        self.tokens: Tensor | None = None
        self.n_kv: int | None = None  # KV heads seen in v: the unit of value-only figures (SPEC §4)
        self.sinks = _sink.SinkRun(sink, len(layer_ids), n_windows)
        self.probing = False  # a first pass that only reads the first 32 keys (sink='auto')
        # sink='auto' reads every layer of the model (SPEC §1): the other layers and their windows,
        # read only while probing.
        self.choice = choice
        self.local = _local.LocalSinks(self.windows, n_windows)  # of sliding-window layers (ours)
        self.progress: Any = None  # advanced by one per layer of a batch analysed (a bar, or lines)

    def hooks(self) -> list[tuple[str, Any]]:
        names = [(layer, hook.format(layer=layer)) for layer in self.row
                 for hook in (_cache.VALUE_HOOK, _cache.PATTERN_HOOK)]
        choosing = [(_cache.PATTERN_HOOK.format(layer=layer), self._choice_pattern(layer))
                    for layer in self.choice]
        return [(name, self._store(name, layer)) for layer, name in names] + choosing

    def _choice_pattern(self, layer: int) -> Any:
        """A hook on a layer that is not analysed: its first keys' attention while probing."""
        def hook(tensor: Tensor, hook: Any = None) -> None:
            if self.probing:
                self._choice_mass(layer, PatternRows(tensor.detach()))
            self._stop_after(layer)

        return hook

    def _choice_mass(self, layer: int, rows: Any) -> None:
        """The first keys' attention of a layer read for ``sink='auto'`` alone."""
        self.sinks.probe(layer, None, rows, self.mask.to(rows.device), self.choice[layer])

    def _store(self, name: str, layer: int) -> Any:
        def hook(tensor: Tensor, hook: Any = None) -> None:
            seen = self.pending.setdefault(layer, {})
            # Only read, never written: the engine makes new tensors, so no copy is needed.
            seen[name] = tensor.detach()
            if len(seen) == 2:  # both hooks of this layer have fired, in whichever order
                pattern, v = _cache.read_layer(self.pending.pop(layer), layer, upcast=False)
                if (pattern.shape[0], pattern.shape[-1]) != tuple(self.mask.shape):
                    shape = tuple(pattern.shape)
                    raise ValueError(f"Layer {layer}: pattern {shape} does not match the batch.")
                self._analyze(layer, pattern, v)
                self._stop_after(layer)

        return hook

    def _stop_after(self, layer: int) -> None:
        """End the forward after the last layer this pass reads (the analysed layers, and while
        probing the layers that only choose the sink): nothing after it is computed."""
        if layer == max([*self.row, *(self.choice if self.probing else ())]):
            raise StopForward

    def capture(self, model: Any, tokens: Tensor, mask: Tensor | None) -> None:
        """One batch by the recompute path: every analysed layer's captured q/k/v to the engine.
        While probing (``sink='auto'``), in one forward too: every layer's first 32 keys are read
        as it runs and its capture is kept (:class:`.stash.CaptureStash`); once all are read the
        sinks are chosen and the kept layers analysed."""
        seen: set[int] = set()
        key_mask = None if mask is None else self.mask
        stash = CaptureStash() if self.probing else None

        def on_layer(c: LayerCapture) -> None:
            if c.layer not in self.row:
                if self.probing and c.layer in self.choice:
                    self._choice_mass(c.layer, RecomputedRows(c, key_mask))
                return
            seen.add(c.layer)
            self._captured(c, key_mask)
            if stash is not None:
                stash.keep(c)

        try:
            # The probing pass reads the first keys' weights: from each query's log-sum-exp where
            # the layer's kernel gives it (no second attention pass).
            capture_attention(model, tokens, on_layer, attention_mask=mask,
                              logsumexp=stash is not None)
            missing = sorted(set(self.row) - seen)
            if missing:
                raise _cache.CacheError(f"Layers {missing} ran no attention the capture could see: "
                                        "the model's attention must go through transformers' "
                                        "attention functions.")
            if stash is not None:
                self.sink = self.sinks.choose(self.mask)
                self.probing = False
                for c in stash.drain():
                    self._captured(c, key_mask)
        finally:
            self.probing = False
            if stash is not None:
                stash.close()

    def _captured(self, c: LayerCapture, key_mask: Tensor | None) -> None:
        """One captured layer of the batch to the engine."""
        window = self.windows[self.row[c.layer]]
        if self.from_config and window != c.params.window:
            raise ValueError(f"Layer {c.layer}: the model config gives sliding window {window} but its "
                             f"attention ran with {c.params.window}; pass window= explicitly.")
        self._analyze(c.layer, RecomputedRows(c, key_mask), c.v)

    def _analyze(self, layer: int, rows: Any, v: Tensor) -> None:
        """One layer of one batch, read (rows: a pattern or recomputed rows, on ``v``'s device) by
        every analysis; its first 32 keys' attention is read once (in the probing pass, if any)."""
        self.n_kv = int(v.shape[2])
        mask = self.mask.to(v.device)
        row = self.row[layer]
        window = self.windows[row]
        source = rows if not isinstance(rows, Tensor) else PatternRows(rows)
        if self.probing:
            self.sinks.probe(layer, row, source, mask, window)
            return
        assert self.sink is not None  # None only while 'auto' probes
        sink = self.sink.to(v.device)
        W = None if self.W is None else self.W[layer].to(v.device)
        read = None  # the sink check's reading, as the first analysis read it (the same rows for all)
        for acc, opts in self.runs:
            stats = analyze_layer(rows, v, mask, sink, opts, layer=layer, W_O=W, sequence_offset=self.offset,
                                  mask_given=self.mask_given, window=window)
            acc.add(row, stats, self.offset)
            read = stats.first_keys if read is None else read
        if not self.sinks.auto:  # given sinks: checked on the rows the analysis has just read
            self.sinks.probe(layer, row, source, mask, window, sink, read)
        if window is not None:  # after the engine has checked the rows against the window
            local = _local.layer_local_sink(rows, v, mask, sink, window, self.tokens)
            self.local.add(row, self.offset, local)
        if self.progress is not None:
            self.progress.update()


def _check_shard(shard: Any) -> tuple[int, int] | None:
    """``(rank, world_size)`` with an initialised process group, checked before any forward."""
    if shard is None:
        return None
    if (not isinstance(shard, tuple) or len(shard) != 2
            or any(isinstance(x, bool) or not isinstance(x, int) for x in shard)
            or not 0 <= shard[0] < shard[1]):
        raise ValueError(f"shard must be (rank, world_size) with 0 ≤ rank < world_size, got {shard!r}.")
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("shard=(rank, world_size) needs an initialised torch.distributed process "
                         "group: launch with torchrun and call dist.init_process_group() first.")
    if dist.get_world_size() != shard[1]:
        raise ValueError(f"shard says world_size {shard[1]} but the process group has "
                         f"{dist.get_world_size()} processes.")
    return shard


def analyze_model(
    model: Any,
    inputs: Tensor | str | Sequence[str],
    *,
    batch_size: int = 8,
    attention_mask: Tensor | None = None,
    layers: Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool | None = None,
    attention: AttentionSource = "auto",
    window: Window = "auto",
    sink: Sink = None,
    **options: Unpack[AnalysisArgs],
) -> HeadAnalysis:
    """:func:`analyze_heads` computed inside the forward pass, batch by batch, without a cache.

    Runs ``model`` (a TransformerBridge, HookedTransformer, or any model with the same hook
    names and a ``hooks(fwd_hooks=...)`` context) on ``inputs`` in batches of ``batch_size``;
    peak memory is one layer of one batch. The result equals ``analyze_heads`` on the full
    cache of the same inputs (same seeds), local sinks included.

    Args:
        inputs: token ids ``[n, pos]`` (with ``attention_mask`` if padded), a text, or a list
            of texts (tokenized here, BOS prepended where the model was trained with one,
            right-padded and masked: the safe way to analyse texts of different lengths).
        shard: ``(rank, world_size)``: analyse only this rank's contiguous share of the
            sequences and all-reduce the sums (``torch.distributed`` must be initialised);
            every rank returns the merged result.
        attention: where the attention rows come from. ``"pattern"``: the model's
            ``hook_pattern`` (eager attention). ``"recompute"``: the Hugging Face forward runs
            with SDPA and no LM head, and only the rows the analysis reads are recomputed in
            float64 from each layer's captured queries and keys
            (:mod:`tl_geometry.analyze.recompute`), equal to the pattern path's to float32
            round-off (about 1e-6 in α). ``"auto"``: recompute when one layer's pattern for one
            batch would exceed :data:`AUTO_RECOMPUTE_BYTES` and the model can, else the pattern.
        window: as for :func:`tl_geometry.analyze_heads`; ``"auto"`` (default) reads the model's
            config (Gemma-3's local layers see 512 keys).
        sink: as for :func:`tl_geometry.analyze_heads`. ``"auto"`` reads every layer of the model
            before analysing any: the recompute path keeps each layer's capture until then (in
            memory up to :data:`~tl_geometry.analyze.stash.STASH_BYTES`, the rest in a temporary
            folder), the pattern path runs each batch twice. Pass the recorded
            ``metadata["sink"]["positions"]`` as ``sink=`` to skip that.

    The other arguments, and the analysis options (``n_values``, ``queries``, ``seed``, ...:
    :class:`~tl_geometry.engine.options.AnalysisArgs`), are those of
    :func:`tl_geometry.analyze_heads`.

    Examples:
        >>> result = tl_geometry.analyze_model(model, tokens, batch_size=4)  # doctest: +SKIP
    """
    check_option_names(options, "analyze_model")
    opts = check_options(**options)
    return _analyze_model(model, inputs, [opts], batch_size=batch_size, attention_mask=attention_mask,
                          layers=layers, shard=shard, progress=progress, attention=attention,
                          window=window, sink=sink)[0]


def analyze_model_nulls(
    model: Any,
    inputs: Tensor | str | Sequence[str],
    *,
    nulls: Sequence[str] = SHUFFLE_KINDS,
    batch_size: int = 8,
    attention_mask: Tensor | None = None,
    layers: Sequence[int] | None = None,
    shard: tuple[int, int] | None = None,
    progress: bool | None = None,
    attention: AttentionSource = "auto",
    window: Window = "auto",
    sink: Sink = None,
    **options: Unpack[AnalysisArgs],
) -> dict[str, HeadAnalysis]:
    """One analysis per null of SPEC §3 (``shuffle=`` kind), all from one forward pass.

    The nulls decompose the value-shuffle gap F*(top) − F*(values)
    (:func:`tl_geometry.result.null_decomposition`). ``result[kind]`` equals
    ``analyze_model(model, inputs, shuffle=kind, ...)`` bit for bit, except that the random
    baseline and the bounds, which no null changes, are computed for ``"values"`` only (every
    other null runs with ``random_samples=0, bounds=False``).

    Args:
        nulls: the kinds to analyse, each once, from ``"values"``, ``"norms"``,
            ``"directions"`` and ``"unselected"`` (default: all four).

    The other arguments and options (except ``shuffle``) are those of :func:`analyze_model`.

    Examples:
        >>> by_null = tl_geometry.analyze_model_nulls(model, tokens)  # doctest: +SKIP
        >>> tl_geometry.result.null_decomposition(by_null)  # doctest: +SKIP
    """
    check_option_names(options, "analyze_model_nulls", refused=("shuffle",))  # nulls= names them
    kinds = _check_nulls(nulls)
    runs = [check_options(**{**options, "shuffle": kind} if kind == "values"
                          else {**options, "shuffle": kind, "random_samples": 0, "bounds": False})
            for kind in kinds]
    results = _analyze_model(model, inputs, runs, batch_size=batch_size, attention_mask=attention_mask,
                             layers=layers, shard=shard, progress=progress, attention=attention,
                             window=window, sink=sink)
    return dict(zip(kinds, results))


def _check_nulls(nulls: Any) -> list[str]:
    """The requested nulls as a list, each a known kind and given once."""
    if isinstance(nulls, str) or not isinstance(nulls, Sequence) or not nulls:
        raise ValueError(f"nulls must be a non-empty sequence of {list(SHUFFLE_KINDS)}, got {nulls!r}.")
    unknown = [kind for kind in nulls if kind not in SHUFFLE_KINDS]
    if unknown:
        raise ValueError(f"nulls holds unknown kinds {unknown}; choose from {list(SHUFFLE_KINDS)}.")
    if len(set(nulls)) != len(nulls):
        raise ValueError(f"nulls has duplicates: {list(nulls)}; give each kind once.")
    return list(nulls)


def _analyze_model(model: Any, inputs: Any, runs: Sequence[AnalysisOptions], *, batch_size: int,
                   attention_mask: Tensor | None, layers: Sequence[int] | None,
                   shard: tuple[int, int] | None, progress: bool | None, attention: Any,
                   window: Window, sink: Sink = None) -> list[HeadAnalysis]:
    """The forward passes of :func:`analyze_model`, each layer analysed once per options in
    ``runs`` (validated options that share ``n_values``, ``queries`` and ``space``)."""
    opts = runs[0]
    _windows.check(window)
    _sink.check(sink)
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}.")
    tokens, mask, bos_prepended = _as_tokens(model, inputs, attention_mask)
    chosen = _sink.rule(sink, model, bos_prepended=bos_prepended)
    facts, cfg = model_facts(model), getattr(model, "cfg", None)
    n_seqs, n_pos = _tokens.check_token_tensor(tokens, "inputs", facts.d_vocab).shape
    n_layers, n_heads = facts.shape()
    full_mask = _cache.check_attention_mask(mask, n_seqs, n_pos)
    if mask is None:
        _cache.warn_pad_tokens(tokens, model, (n_seqs, n_heads, n_pos))
    layer_ids = list(range(n_layers)) if layers is None else _cache.check_layer_indices(layers, n_layers)
    layer_windows = _windows.resolve(window, model, layer_ids)
    # Every window's given sink and the given queries against the windows, before any forward.
    check_query_positions(opts.queries, full_mask.sum(-1).tolist())
    if chosen != _sink.AUTO:
        _sink.positions(chosen, full_mask, 0, n_seqs)
    choice = _sink.choice_layers(window, model, layer_ids, range(n_layers)) if chosen == _sink.AUTO else {}
    shard = _check_shard(shard)
    W = output_weights(model, None, layer_ids) if opts.space == "output" else None
    device = getattr(cfg, "device", None) or "cpu"
    # Every rank sizes its per-sequence rows alike, so that all_reduce adds like shapes.
    accs = [Accumulator.zeros(len(layer_ids), n_heads, len(opts.n_values), device=device, n_sequences=n_seqs,
                              n_queries=n_chosen(opts.queries, n_pos), n_blocks=n_blocks(n_pos),
                              per_window=run.per_window)
            for run in runs]
    hooks = _LayerHooks(list(zip(accs, runs)), layer_ids, W, mask_given=mask is not None,
                        windows=layer_windows, from_config=window == _windows.AUTO, sink=chosen,
                        n_windows=n_seqs, choice=choice)
    recompute = recompute_possible(attention, model) and (
        attention == "recompute"
        or pattern_bytes(min(batch_size, n_seqs), n_heads, n_pos) > AUTO_RECOMPUTE_BYTES)

    rank, world = shard or (0, 1)
    lo, hi = rank * n_seqs // world, (rank + 1) * n_seqs // world
    batches = range(lo, hi, batch_size)
    with torch.no_grad(), contextlib.ExitStack() as stack:
        # Progress per layer of each batch: one batch of a long window can take minutes.
        if check_progress(progress):
            hooks.progress = progress_counter(len(batches) * len(layer_ids), "analyze_model", "layer")
            stack.callback(hooks.progress.close)
        if not recompute:
            stack.enter_context(model.hooks(fwd_hooks=hooks.hooks()))
        for start in batches:
            stop = min(start + batch_size, hi)
            hooks.mask, hooks.offset = full_mask[start:stop], start
            hooks.tokens = tokens[start:stop]
            hooks.sink = None if hooks.sinks.auto else hooks.sinks.given(hooks.mask, start)
            batch_tokens = tokens[start:stop].to(device)
            batch_mask = None if mask is None else full_mask[start:stop].long().to(device)
            if recompute:  # one forward, which also chooses the sinks while probing
                hooks.probing = chosen == _sink.AUTO
                hooks.capture(model, batch_tokens, batch_mask)
                continue
            kwargs = {} if batch_mask is None else {"attention_mask": batch_mask}
            for probing in (True, False) if chosen == _sink.AUTO else (False,):
                hooks.probing = probing
                forward_until_stopped(model, batch_tokens, **kwargs)
                if probing:
                    hooks.sink = hooks.sinks.choose(hooks.mask)
            if hooks.pending:
                raise _cache.CacheError(
                    f"Layers {sorted(hooks.pending)} fired only one of hook_pattern / hook_v: the "
                    "model must expose both per-head hooks (attention patterns need eager "
                    "attention)."
                )
    masses, relative = hooks.sinks.check_masses(), hooks.sinks.relative
    if shard is not None:  # every rank records every window's sink and the whole check
        for acc in accs:
            acc.all_reduce()
        hooks.local.all_reduce(lo, hi, n_heads, device)
        masses, relative = _gather_windows(masses, relative, lo, n_seqs, device)
    sink_record = hooks.sinks.record(model, n_layers, masses, relative)
    results = []
    for acc, run in zip(accs, runs):
        metadata = run_metadata(model, model, (n_seqs, n_heads, n_pos), run, mask is not None, facts=facts)
        metadata.update(n_kv_heads=hooks.n_kv or getattr(cfg, "n_key_value_heads", None) or n_heads,
                        cache_type="streaming", batch_size=batch_size, world_size=world,
                        attention="recompute" if recompute else "pattern", sink=sink_record)
        results.append(hooks.local.attach(acc.finish(layer_ids, run, n_pos, metadata, layer_windows)))
    return results


def _gather_windows(masses: list[Tensor], relative: list[int], lo: int, n_seqs: int,
                    device: Any) -> tuple[list[Tensor], list[int]]:
    """The sink check's per-window masses and the sink positions of every rank's windows: each
    rank fills the rows of its own windows (``lo …``) and the rows add up (``all_reduce``)."""
    import torch.distributed as dist

    width = masses[0].shape[1:] if masses else (0,)
    full = torch.zeros(len(masses), n_seqs, *width, dtype=torch.float64, device=device)
    for li, m in enumerate(masses):
        full[li, lo:lo + len(m)] = m.to(full)
    positions = torch.zeros(n_seqs, dtype=torch.long, device=device)
    positions[lo:lo + len(relative)] = torch.tensor(relative, dtype=torch.long)
    dist.all_reduce(full)  # NaN rows stay NaN: no other rank writes them
    dist.all_reduce(positions)
    return [row.cpu() for row in full], positions.cpu().tolist()


def recompute_possible(attention: Any, model: Any) -> bool:
    """``attention`` checked (one of :data:`ATTENTION_SOURCES`; ``"recompute"`` refused, naming
    the fix, for a model without a Hugging Face module to capture from) and whether ``model``
    can be recomputed at all (``False`` for ``"pattern"``)."""
    if attention not in ATTENTION_SOURCES:
        raise ValueError(f"attention must be one of {', '.join(map(repr, ATTENTION_SOURCES))}, "
                         f"got {attention!r}.")
    if attention == "pattern":
        return False
    possible = model_facts(model).can_recompute
    if attention == "recompute" and not possible:
        raise ValueError("attention='recompute' needs a Hugging Face model to capture queries and keys "
                         "from (a transformers model or a TransformerBridge around one); use "
                         "attention='pattern' for this model.")
    return possible

