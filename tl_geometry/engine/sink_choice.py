"""Where the sink is, and how strong it is (SPEC §1, ours): :func:`first_keys_mass` reads one
layer's mean attention on the first :data:`CANDIDATES` real positions (for a given sink the
validation adds the same rows, :func:`check_reading`, so no row is read twice);
:func:`choose_sink` is ``sink="auto"``; :func:`sink_check` is the check every analysis records.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from jaxtyping import Bool, Float, Int
from torch import Tensor

from ..functional.dtypes import COMPUTE_DTYPE
from ..functional.heads import last_positions, sink_positions
from .block import AttentionRows, PatternRows

#: Candidate positions of ``sink="auto"``, and the first query that reads them all (SPEC §1).
CANDIDATES = 32
#: Queries the sink check reads where the sink is given (ours): ``32 ≤ t < 32 + CHECK_QUERIES``,
#: at any context length (it only asks whether the given key is the most attended, and
#: recomputed rows cost ``O(T)`` each); ``sink="auto"`` reads every query up to ``min(T, w)``.
CHECK_QUERIES = 128
#: Bytes of attention rows gathered at once.
ROWS_BYTES = 1 << 26


@runtime_checkable
class LeadingColumns(Protocol):
    """A source that gives the first keys' columns of many queries at once, or ``None`` where it
    cannot (:meth:`tl_geometry.analyze.recompute.RecomputedRows.leading_columns`)."""

    def leading_columns(self, start: Tensor, stop: Tensor, n_keys: int) -> Tensor | None: ...


@torch.inference_mode()  # nothing here is differentiated: no autograd bookkeeping per op
def first_keys_mass(source: AttentionRows, is_token: Bool[Tensor, "batch pos"], window: int | None,
                    max_queries: int | None = None, sink: Int[Tensor, " batch"] | None = None,
                    ) -> Float[Tensor, "batch head 33"]:
    """Mean attention on each of the first 32 real positions of every window (columns 0–31) and
    on its ``sink`` (column 32; NaN without one), over its queries ``32 ≤ t − start < min(T, w)``
    (every such query sees all 32 candidates; a given sink ``p ≥ 32`` moves the first to
    ``p + 1``, ours), at most ``max_queries`` of them; NaN for a window with no such query.
    ``source`` is never written; without a given sink, a :class:`LeadingColumns` source is read
    through its columns.
    """
    batch, n_heads, n_pos = source.shape
    device = source.device
    if isinstance(source, PatternRows):
        mass = _pattern_mass(source.pattern, is_token, window, max_queries, sink)
        if mass is not None:
            return mass
    start, first, stop = _reading(is_token, window, max_queries, sink)
    # The 32 candidates and the sink (the last column; the first candidate where none is given).
    keys = torch.cat([start[:, None] + torch.arange(CANDIDATES, device=device),
                      (start if sink is None else sink.to(device))[:, None]], dim=1).clamp_max(n_pos - 1)
    n_queries = max(0, int((stop - first).max()))
    total = torch.zeros(batch, n_heads, CANDIDATES + 1, dtype=COMPUTE_DTYPE, device=device)
    count = torch.zeros(batch, dtype=COMPUTE_DTYPE, device=device)
    step = max(1, ROWS_BYTES // max(1, batch * n_heads * n_pos * 8))
    columns = None
    if isinstance(source, PatternRows):  # the 33 columns first: no whole row is copied
        columns = source.pattern.gather(3, keys[:, None, None, :].expand(batch, n_heads, n_pos, -1))
    elif sink is None and isinstance(source, LeadingColumns):
        # Every query read sees the 32 candidates: the source may give their columns in one
        # pass (recomputed rows: the layer's own attention kernel), far cheaper than the rows.
        # The last column is the first candidate again (NaN below: no sink is given).
        lead = source.leading_columns(start, stop, CANDIDATES)
        columns = None if lead is None else torch.cat([lead, lead[..., :1]], dim=-1)
    if columns is not None:
        step = max(1, n_queries)
    for q0 in range(0, n_queries, step):
        queries = first[:, None] + torch.arange(q0, min(n_queries, q0 + step), device=device)  # [b, q]
        taken = queries < stop[:, None]
        if columns is not None:
            index = queries.clamp_max(n_pos - 1)[:, None, :, None].expand(batch, n_heads, -1, keys.shape[1])
            alpha = columns.gather(2, index)
        else:
            rows, row_of = source.rows(0, batch, torch.where(taken, queries, -1))
            index = row_of.clamp_min(0)[:, None, :, None].expand(-1, n_heads, -1, rows.shape[-1])
            alpha = rows.gather(2, index).gather(3, keys[:, None, None, :].expand(-1, n_heads, queries.shape[1], -1))
        total += torch.where(taken[:, None, :, None], alpha.to(COMPUTE_DTYPE), 0.0).sum(2)  # padded rows: NaN
        count += taken.sum(1)
    out = total / count[:, None, None]
    if sink is None:
        out[..., CANDIDATES] = torch.nan
    return out


def check_reading(is_token: Bool[Tensor, "batch pos"], window: int | None, sink: Int[Tensor, " batch"]
                  ) -> tuple[Int[Tensor, " batch"], Int[Tensor, " batch"], Int[Tensor, " batch"]]:
    """``(start, first, stop)`` of the sink check of a given ``sink``: each window's first real
    position and the queries ``first ≤ t < stop`` that :func:`first_keys_mass` reads with
    ``max_queries=CHECK_QUERIES``."""
    return _reading(is_token, window, CHECK_QUERIES, sink)


def _reading(is_token: Tensor, window: int | None, max_queries: int | None, sink: Tensor | None
             ) -> tuple[Tensor, Tensor, Tensor]:
    """``(start, first, stop)`` of :func:`first_keys_mass`: the queries ``first ≤ t < stop``."""
    start, last = sink_positions(is_token), last_positions(is_token)
    length = last - start + 1
    stop = start + (length if window is None else length.clamp_max(window))  # first query not read
    first = start + CANDIDATES if sink is None else torch.maximum(start + CANDIDATES, sink.to(start.device) + 1)
    if max_queries is not None:
        stop = torch.minimum(stop, first + max_queries)
    return start, first, stop


def _pattern_mass(pattern: Float[Tensor, "batch head query key"], is_token: Tensor,
                  window: int | None, max_queries: int | None, sink: Tensor | None
                  ) -> Float[Tensor, "batch head 33"] | None:
    """:func:`first_keys_mass` of a pattern whose windows are all read at the same positions (no
    padding, one sink): one slice of it, summed where it lies; ``None`` where they are not."""
    if not bool(is_token.all()):
        return None
    given = set() if sink is None else set(sink.tolist())
    if len(given) > 1:
        return None
    batch, n_heads = pattern.shape[:2]
    n_pos, p = is_token.shape[1], given.pop() if given else 0
    first = CANDIDATES if sink is None else max(CANDIDATES, p + 1)
    stop = n_pos if window is None else min(n_pos, window)
    if max_queries is not None:
        stop = min(stop, first + max_queries)
    if stop <= first:  # no query to read
        return torch.full((batch, n_heads, CANDIDATES + 1), torch.nan, dtype=COMPUTE_DTYPE, device=pattern.device)
    rows = pattern[:, :, first:stop]
    column = min(p, n_pos - 1)
    # The sink's column as one contiguous column, as a gather would lay it out.
    sink_column = (rows[..., column:column + 1].contiguous().sum(2, dtype=COMPUTE_DTYPE) if sink is not None
                   else rows.new_full((batch, n_heads, 1), torch.nan, dtype=COMPUTE_DTYPE))
    return torch.cat([rows[..., :CANDIDATES].sum(2, dtype=COMPUTE_DTYPE), sink_column], dim=-1) / (stop - first)


def choose_sink(masses: Sequence[Float[Tensor, "batch head 32"]]) -> Int[Tensor, " batch"]:
    """``sink="auto"``: each window's candidate with the largest mean mass over every layer and
    head (ties → lower index; a window without a reading query takes its first position).
    Returns positions counted from each window's first real token. The front doors pass every
    layer of the model (or of the cache), in layer order, whatever ``layers=`` analyses
    (:func:`tl_geometry.analyze.sink.choice_layers`): one order of summation, so a subset
    analysis picks the key a full one picks, ties included.

        >>> m = torch.zeros(1, 2, 32); m[0, :, 3] = 0.5; m[0, 0, 0] = 0.4
        >>> choose_sink([m]).tolist()
        [3]
    """
    # A layer that no query can read (a window of 32 keys or less) is left out, not a NaN for all.
    stacked = torch.stack([m[..., :CANDIDATES].mean(1) for m in masses]).nanmean(0)  # [b, 32]
    read = ~torch.isnan(stacked).any(-1)
    return torch.where(read, torch.nan_to_num(stacked, nan=-1.0).argmax(-1), 0)


def sink_check(masses: Sequence[Float[Tensor, "batch head 32"]], sink: Int[Tensor, " batch"]) -> dict[str, Any]:
    """The sink check of SPEC §1 (ours): per layer, the mean attention mass of the sink, that of
    each window's most attended other candidate, and the candidate most often that one; ``weak``
    where the sink is less attended in most layers where both are read (ties count for the
    sink). ``sink`` counts from each window's first real token; unread windows are left out."""
    if not masses:
        return {"sink_mass": [], "other_mass": [], "other_key": [], "weak": False, "layers_read": 0}
    # Every layer at once; a layer with unread windows is read again over its read ones.
    per_key = torch.stack(list(masses)).mean(2)  # [layer, b, 33]
    read = ~torch.isnan(per_key[..., :CANDIDATES]).any(-1)  # [layer, b]
    sink_mass, other_mass, other_key = (x.tolist() for x in _sink_and_other(per_key, sink))
    for layer in (~read.all(1)).nonzero().flatten().tolist():
        if bool(read[layer].any()):
            row = _sink_and_other(per_key[layer, read[layer]][None], sink.to(per_key.device)[read[layer]])
            sink_mass[layer], other_mass[layer], other_key[layer] = (x.item() for x in row)
        else:
            sink_mass[layer] = other_mass[layer] = other_key[layer] = None
    judged = [(s, o) for s, o in zip(sink_mass, other_mass) if s is not None and o is not None]
    strong = sum(s >= o for s, o in judged)
    return {"sink_mass": sink_mass, "other_mass": other_mass, "other_key": other_key,
            "weak": bool(judged) and 2 * strong < len(judged), "layers_read": len(judged)}


def _sink_and_other(per_key: Float[Tensor, "layer batch 33"], sink: Int[Tensor, " batch"]
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Per layer, :func:`sink_check`'s three figures."""
    at = sink.to(per_key.device)
    inside = at < CANDIDATES
    candidates = per_key[..., :CANDIDATES]
    index = at.clamp_max(CANDIDATES - 1)[None, :, None].expand(per_key.shape[0], -1, 1)
    own = torch.where(inside, candidates.gather(2, index).squeeze(2), per_key[..., CANDIDATES])
    others = torch.where(inside[:, None] & (torch.arange(CANDIDATES, device=at.device) == at[:, None]),
                         -torch.inf, candidates)
    best, key = others.max(-1)
    return own.mean(1), best.mean(1), torch.mode(key, dim=1).values
