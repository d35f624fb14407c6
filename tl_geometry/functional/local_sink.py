"""The local sink of a sliding-window head: where the queries that cannot see the sink put
their mass (ours, in the spirit of SPEC §1).

On a layer with sliding window ``w`` and the sink at position ``p`` (SPEC §1), a query ``t``
whose window starts after the sink (``t − w + 1 > p``, i.e. ``t ≥ p + w``) cannot see it. Over
the real such queries ``B`` of one sequence and one query head (``α[t, j] = 0`` where key ``j``
is outside ``t``'s window ``t − w < j ≤ t`` or is padding)::

    m_j      = (1/|B|) Σ_{t∈B} α[t, j]                     mean attention of key j
    K        = {real keys j : some t ∈ B has t − w < j ≤ t}   keys the beyond queries see
    j*       = argmax_{j∈K} m_j                            the local sink (ties → lower index)
    position = j* − start                                  start: the first real token
    mass     = m_{j*}
    coverage = |{t ∈ B : t − w < j* ≤ t}| / |B|            share of B whose window holds j*
    kappa    = ‖v_{j*}‖ / mean_{j∈K∖{j*}} ‖v_j‖            SPEC §4's κ, v of the head's KV group
    token    = tokens[j*]                                  NaN where the tokens are not given

Every figure is NaN where ``B`` is empty (a window as long as the sequence; a global layer has
none). Sums are float64 whatever the rows' dtype. Only the column sums ``Σ_{t∈B} α[t, j]``
read attention rows, and they add up over blocks of queries (:func:`beyond_columns`), so a
caller never needs to hold more than a block of rows.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from jaxtyping import Bool, Float, Int, Shaped
from torch import Tensor

from .dtypes import COMPUTE_DTYPE
from .figures import labels
from .heads import kv_head_index, sink_positions

#: The figures of a local sink, in storage order (``HeadAnalysis.local_sink``'s ``local_field``
#: axis, :data:`.figures.FIGURES`).
LOCAL_SINK_FIELDS: tuple[str, ...] = labels("local_field")


class LocalSink(NamedTuple):
    """The local sink of each (sequence, head) (module docstring), each ``[batch, head]``
    float64, NaN where no query is beyond the window."""

    position: Float[Tensor, "batch head"]
    mass: Float[Tensor, "batch head"]
    coverage: Float[Tensor, "batch head"]
    kappa: Float[Tensor, "batch head"]
    token: Float[Tensor, "batch head"]

    def stack(self) -> Float[Tensor, "batch local_field head"]:
        """The figures as one tensor, in :data:`LOCAL_SINK_FIELDS` order."""
        return torch.stack(tuple(self), dim=1)


def _window(window: object) -> int:
    if isinstance(window, bool) or not isinstance(window, numbers.Integral) or window < 1:
        raise ValueError(f"window={window!r} must be a positive int (the sliding window of the layer); "
                         "a global layer has no local sink.")
    return int(window)


def _key_mask(key_mask: Tensor | None, batch: int, n_pos: int, device: torch.device) -> Tensor:
    if key_mask is None:
        return torch.ones(batch, n_pos, dtype=torch.bool, device=device)
    if tuple(key_mask.shape) != (batch, n_pos):
        raise ValueError(f"key_mask has shape {tuple(key_mask.shape)}; expected [batch, pos] = "
                         f"[{batch}, {n_pos}] (True or 1 on real tokens).")
    return key_mask.to(device=device, dtype=torch.bool)


def beyond_window(
    key_mask: Shaped[Tensor, "batch pos"],
    sink: Int[Tensor, " batch"] | int,
    window: int,
) -> Bool[Tensor, "batch pos"]:
    """The beyond-window queries ``B``: real queries ``t`` whose window starts after the sink
    (absolute position), ``t − window + 1 > sink`` (SPEC §1: they cannot see it).

    >>> beyond_window(torch.ones(1, 6, dtype=torch.bool), torch.tensor([0]), 4).int().tolist()
    [[0, 0, 0, 0, 1, 1]]
    """
    window = _window(window)
    mask = key_mask.to(torch.bool)
    sink = torch.as_tensor(sink, device=mask.device).reshape(-1, 1) if not isinstance(sink, int) else sink
    positions = torch.arange(mask.shape[-1], device=mask.device)
    return mask & (positions - window + 1 > sink)


def beyond_columns(
    alpha: Float[Tensor, "batch head query key"],
    beyond: Bool[Tensor, "batch query"],
) -> Float[Tensor, "batch head key"]:
    """``Σ_{t∈B} α[t, j]`` over the given query rows, float64: rows outside ``B`` add nothing,
    even NaN ones (padding queries). Sums over blocks of queries add up to the sum over all.

    >>> alpha = torch.tensor([[[[1.0, 0.0], [0.25, 0.75]]]])
    >>> beyond_columns(alpha, torch.tensor([[False, True]])).tolist()
    [[[0.25, 0.75]]]
    """
    if alpha.ndim != 4 or beyond.shape != (alpha.shape[0], alpha.shape[2]):
        raise ValueError(f"alpha must be [batch, head, query, key] and beyond [batch, query] of the same "
                         f"queries; got alpha {tuple(alpha.shape)} and beyond {tuple(beyond.shape)}.")
    keep = beyond.to(device=alpha.device, dtype=torch.bool)[:, None, :, None]
    return torch.where(keep, alpha.to(COMPUTE_DTYPE), 0.0).sum(2)


def local_sink_from_columns(
    columns: Float[Tensor, "batch head key"],
    beyond: Bool[Tensor, "batch key"],
    values: Float[Tensor, "batch key kv d"],
    *,
    window: int,
    key_mask: Shaped[Tensor, "batch key"] | None = None,
    tokens: Int[Tensor, "batch key"] | None = None,
) -> LocalSink:
    """The local sink (module docstring) from the column sums ``columns[b, h, j] = Σ_{t∈B} α[t, j]``
    (:func:`beyond_columns`) and the beyond queries ``beyond`` (:func:`beyond_window`). ``values``
    are ``hook_v``, read per KV head by index (SPEC §1), ``key_mask`` False on padding (default:
    every key is real), ``tokens`` the token ids of the ``token`` field.

    >>> columns = torch.tensor([[[0.0, 0.5, 1.5]]])          # two beyond queries (t = 1, 2)
    >>> beyond = torch.tensor([[False, True, True]])
    >>> s = local_sink_from_columns(columns, beyond, torch.ones(1, 3, 1, 2), window=2)
    >>> s.position.tolist(), s.mass.tolist(), s.coverage.tolist(), s.kappa.tolist()
    ([[2.0]], [[0.75]], [[0.5]], [[1.0]])
    """
    window = _window(window)
    if columns.ndim != 3 or values.ndim != 4:
        raise ValueError(f"columns must be [batch, head, key] and values [batch, key, kv_head, d]; got "
                         f"{tuple(columns.shape)} and {tuple(values.shape)}.")
    batch, n_heads, n_pos = columns.shape
    if tuple(beyond.shape) != (batch, n_pos) or tuple(values.shape[:2]) != (batch, n_pos):
        raise ValueError(f"columns {tuple(columns.shape)}, beyond {tuple(beyond.shape)} and values "
                         f"{tuple(values.shape)} must agree in batch and keys.")
    if tokens is not None and tuple(tokens.shape) != (batch, n_pos):
        raise ValueError(f"tokens has shape {tuple(tokens.shape)}; expected the [batch, pos] = "
                         f"[{batch}, {n_pos}] token ids of these sequences.")
    device = columns.device
    is_token = _key_mask(key_mask, batch, n_pos, device)
    beyond = beyond.to(device=device, dtype=torch.bool)
    columns = columns.to(COMPUTE_DTYPE)
    n_beyond = beyond.sum(-1)  # |B| per sequence
    # How many beyond queries see key j (t ∈ [j, j + w − 1]), from a prefix count: O(T).
    prefix = torch.nn.functional.pad(beyond.long().cumsum(-1), (1, 0))
    keys = torch.arange(n_pos, device=device)
    seen_by = prefix[:, (keys + window).clamp_max(n_pos)] - prefix[:, keys]  # [b, key]
    seen = (seen_by > 0) & is_token
    # Only keys some beyond query sees are candidates (the others have m_j = 0 anyway); argmax
    # returns the first maximum: ties go to the lower index.
    star = torch.where(seen[:, None, :], columns, -torch.inf).argmax(-1)  # [b, h]
    count = n_beyond.to(COMPUTE_DTYPE)[:, None]
    mass = columns.gather(-1, star[..., None])[..., 0] / count
    coverage = seen_by.gather(-1, star).to(COMPUTE_DTYPE) / count
    kv = kv_head_index(n_heads, values.shape[2]).to(device)
    norms = torch.linalg.vector_norm(values, dim=-1, dtype=COMPUTE_DTYPE)[:, :, kv].transpose(1, 2)  # [b, h, key]
    others = seen[:, None, :] & (keys != star[..., None])
    mean_other = torch.where(others, norms, 0.0).sum(-1) / others.sum(-1)
    kappa = norms.gather(-1, star[..., None])[..., 0] / mean_other
    position = (star - sink_positions(is_token)[:, None]).to(COMPUTE_DTYPE)
    nan = torch.full_like(mass, torch.nan)
    token = nan if tokens is None else tokens.to(device).gather(-1, star).to(COMPUTE_DTYPE)
    defined = (n_beyond > 0)[:, None].expand_as(mass)
    return LocalSink(*(torch.where(defined, x, nan) for x in (position, mass, coverage, kappa, token)))


def local_sink(
    alpha: Float[Tensor, "batch head query key"],
    values: Float[Tensor, "batch key kv d"],
    *,
    window: int,
    sink: Int[Tensor, " batch"] | int | None = None,
    key_mask: Shaped[Tensor, "batch key"] | None = None,
    tokens: Int[Tensor, "batch key"] | None = None,
) -> LocalSink:
    """The local sink of every (sequence, head) of a sliding-window layer, from its attention
    rows (ours; module docstring): over the queries ``B`` that cannot see the sink
    (``t − window + 1 > sink``), the key ``j*`` with the largest mean attention
    ``m_j = (1/|B|) Σ_{t∈B} α[t, j]`` (ties → lower index), with its position (from the first
    real token), mass ``m_{j*}``, coverage (the share of ``B`` whose window holds it), κ
    (``‖v_{j*}‖`` over the mean ``‖v_j‖`` of the other keys ``B`` sees, the head's KV group's
    values, SPEC §4) and token id (NaN without ``tokens``). NaN where ``B`` is empty.

    ``alpha`` is ``[batch, head, query, key]`` (``hook_pattern``: every query's row, zero outside
    its window), ``values`` ``[batch, key, kv_head, d]`` (``hook_v``), ``sink`` each sequence's
    sink position (default: its first real token), ``key_mask`` False on padding.

    >>> alpha = torch.tensor([[[[1.0, 0.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.25, 0.75]]]])
    >>> s = local_sink(alpha, torch.ones(1, 3, 1, 4), window=2, tokens=torch.tensor([[7, 8, 9]]))
    >>> s.position.tolist(), s.mass.tolist(), s.coverage.tolist(), s.token.tolist()
    ([[2.0]], [[0.75]], [[1.0]], [[9.0]])
    """
    if alpha.ndim != 4 or alpha.shape[2] != alpha.shape[3]:
        raise ValueError(f"alpha must be [batch, head, query, key] with one query per key position; "
                         f"got {tuple(alpha.shape)}.")
    batch, _, n_pos, _ = alpha.shape
    is_token = _key_mask(key_mask, batch, n_pos, alpha.device)
    if sink is None:
        sink = sink_positions(is_token)
    beyond = beyond_window(is_token, sink, window)
    return local_sink_from_columns(beyond_columns(alpha, beyond), beyond, values, window=window,
                                   key_mask=is_token, tokens=tokens)
