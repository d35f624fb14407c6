"""The one choice between the compiled kernels and their torch twins, and the table of entry
points the orchestration calls.

:func:`choose_backend` picks :data:`NUMBA` (the kernels of :mod:`.compiled`, imported on the
first CPU layer) or :data:`TORCH` (the twins of :mod:`.twins`) once per layer. Both take and
write torch tensors with the same arguments (the compiled entries hand the kernels NumPy views
of the tensors' own memory), so the orchestration never asks which it holds.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, NamedTuple, TypeVar

import numpy as np
import torch
from torch import Tensor

from ..warn import warn_caller
from . import votes
from .block import LayerBlock
from .layout import (
    F_SCORE,
    SINK_REMOVED,
    TOP_GROUP,
    Reduced,
    ScoreChunk,
    ScoreOutputs,
    ScoreSettings,
)
from .paired import N_BINS
from .twins import check as twin_check
from .twins import geometry as twin_geometry
from .twins import reduce as twin_reduce
from .twins import score as twin_score

T = TypeVar("T")


class FromKeys(NamedTuple):
    """The compiled kernels of the votes from queries and keys (:mod:`.key_votes`), on NumPy
    arrays (:mod:`.compiled.vote`; ``check_rows``: :func:`.compiled.check.check_and_vote_rows`)."""

    vote_from_keys: Callable[..., None]
    check_rows: Callable[..., None]
    vote_from_logits: Callable[..., None]


@dataclass(frozen=True)
class Backend:
    """The entry points of one backend, each writing its outputs in place; each mirrors the
    kernel of its name in :mod:`.compiled` (``check_and_vote``: validation, votes and the sink
    check's sums of a block of rows; ``gram``: the tied Gram matrices, on a sliding-window layer
    only the band it reads, :func:`.twins.geometry.band_gram`; ``score_vectors``: the value
    vectors laid out as ``score_rows`` reads them; ``tally``: :func:`.votes.tally`).
    """

    name: str
    upcast_rows: bool
    """The kernels read float32 or float64 rows only: a half-precision pattern is upcast."""
    check_and_vote: Callable[..., None]
    sink_geometry: Callable[..., None]
    gram: Callable[[Tensor, int], Tensor]
    score_vectors: Callable[[LayerBlock, Tensor], Tensor]
    score_rows: Callable[[ScoreChunk, ScoreSettings, ScoreOutputs], None]
    reduce_rows: Callable[[Tensor, Tensor, Tensor, Tensor], Reduced]
    tally: Callable[[Tensor, Tensor, Tensor, Tensor, int], votes.Tally]
    from_keys: FromKeys | None
    """``None``: no vote from queries and keys; the votes are read from the rows."""


def choose_backend(device: torch.device, name: str) -> Backend:
    """The backend of a layer on ``device`` for the ``backend`` option ``name``: ``"auto"``
    takes the compiled kernels on CPU until they have failed, the twins elsewhere."""
    if name == "numba" and device.type != "cpu":
        raise ValueError(f"backend='numba' runs on CPU tensors; this cache is on {device}. "
                         "Use backend='auto' (torch on this device) or move the cache.")
    if name == "torch" or device.type != "cpu" or (name == "auto" and _fallback is not None):
        return TORCH
    try:
        _kernels()
    except _LOAD_ERRORS as error:  # numba missing or broken, or no folder to cache the kernels in
        if name == "numba":
            raise
        _fall_back(error, loading=True)
        return TORCH
    return NUMBA


def run_layer(backend: Backend, name: str, work: Callable[[Backend], T]) -> T:
    """``work(backend)``, one layer's work on the backend :func:`choose_backend` gave for the
    option ``name``; on the compiled kernels the first layer compiles every specialisation
    (:func:`_compile_all`, announced by :func:`.compiled.compilation.reporting`). A kernel that
    numba cannot compile makes the layer start over on the twins (``work`` must write only what
    it creates) and ``"auto"`` keep to them, with one warning; a forced ``"numba"`` re-raises."""
    if backend is not NUMBA:
        return work(backend)
    compilation = _kernels().compilation
    try:
        with compilation.reporting():
            _compile_all()
            return work(backend)
    except compilation.COMPILE_ERRORS as error:
        if name == "numba":
            raise
        _fall_back(error, loading=False)
    return work(TORCH)


#: What importing the kernels raises when numba cannot serve: not installed or broken
#: (ImportError, a shared library that will not load), or no writable folder for its disk cache
#: (RuntimeError "cannot cache function ...: no locator available").
_LOAD_ERRORS = (ImportError, OSError, RuntimeError)
#: The error that sent ``backend="auto"`` to the torch twins for the rest of the process.
_fallback: BaseException | None = None


@functools.cache
def _kernels() -> Any:
    """The compiled modules, imported (numba with them) on first use."""
    from .compiled import check, compilation, geometry, reduce, score, signatures, vote

    return SimpleNamespace(check=check, compilation=compilation, geometry=geometry, reduce=reduce, score=score,
                           signatures=signatures, vote=vote)


@functools.cache
def _compile_all() -> None:
    """Every specialisation the engine calls, compiled (all in the first run: "once per install")
    or loaded, once per process; kernels cached with other result slots are refused."""
    _kernels().signatures.compile_all()
    _kernels().signatures.check_slots()


def _fall_back(error: BaseException, *, loading: bool) -> None:
    """Use the torch twins for the rest of the process, and say so once."""
    global _fallback
    _fallback = error
    detail = (str(error).strip().splitlines() or [""])[0][:300]
    fix = ("set NUMBA_CACHE_DIR to a writable folder" if "cannot cache" in str(error)
           else "reinstall numba (pip install --force-reinstall numba)")
    warn_caller(
        f"tl_geometry: the compiled (numba) kernels {'could not be loaded' if loading else 'failed to compile'} "
        f"({type(error).__name__}: {detail}). This run uses the torch backend instead: its results "
        "equal the compiled kernels' to float64 round-off (the two are tested against each other); "
        f"only the speed differs. Fix: {fix}, or pass backend='torch' to choose the torch backend "
        "without this warning.")


def _numpy(x: Any) -> Any:
    """NumPy view of a CPU tensor, contiguous so that each kernel compiles for one layout."""
    if not isinstance(x, Tensor):
        return x
    out = x.numpy(force=True)  # detached; on CPU, the tensor's own memory
    return out if out.flags.c_contiguous else np.ascontiguousarray(out)


def _written(x: Tensor) -> Any:
    """NumPy view of an output the kernel writes in place: the tensor's own memory, never a copy."""
    return x.numpy()


def _check_and_vote(rows: Tensor, q_start: int, is_token: Tensor, sink: Tensor, norms: Tensor, group_size: int,
                    window: int, stats: Tensor, vote_of: Tensor, first: Tensor, stop: Tensor, start: Tensor,
                    first_keys: Tensor) -> None:
    if rows.dtype not in (torch.float32, torch.float64):
        rows = rows.float()  # the kernel reads float32 or float64 rows
    _kernels().check.check_and_vote(_numpy(rows), q_start, *(_numpy(x) for x in (is_token, sink, norms)),
                                    group_size, window, stats.numpy(), vote_of.numpy(),
                                    *(_numpy(x) for x in (first, stop, start)), first_keys.numpy())


def _sink_geometry(values: Tensor, is_token: Tensor, sink: Tensor, queries: Tensor, h0: int,
                   group_size: int, window: int, sink_fields: Tensor) -> None:
    _kernels().geometry.sink_geometry(*(_numpy(x) for x in (values, is_token, sink, queries)), h0, group_size,
                                      sink_fields.numpy(), window)


def _gram(values: Tensor, window: int) -> Tensor:
    # Our own contiguous tensor: the kernel ties it in place, writing through its view.
    gram = twin_geometry.band_gram(values.detach(), window)
    _kernels().geometry.tie_duplicates(_numpy(values), gram.numpy(), min(window, gram.shape[-1]))
    return gram


def _score_vectors(data: LayerBlock, chunk: Tensor) -> Tensor:
    """The value vectors as the compiled kernel reads them: float32 where every entry is a
    float32 number (a float32 or narrower cache, no ``W_O``), else float64. The kernel widens
    each entry exactly, so its sums are the same bit for bit, reading half the bytes."""
    if data.W_O is None and data.v.dtype in (torch.float32, torch.float16, torch.bfloat16):
        return chunk.to(torch.float32).contiguous()
    return chunk.contiguous()


def _score_rows(chunk: ScoreChunk, settings: ScoreSettings, outputs: ScoreOutputs) -> None:
    # The kernel takes the same records of NumPy views. The outputs are views into the layer's
    # results, written through NumPy views of them. A block of the queries (recomputed rows) is a
    # strided view, which numba would compile a second kernel for (layout "A"): the kernel writes
    # a contiguous copy of it instead, copied back, so that one specialisation serves every layout.
    staged = ScoreOutputs(*(x if x.numpy().flags.c_contiguous else x.contiguous() for x in outputs))
    _kernels().score.score_rows(ScoreChunk(*map(_numpy, chunk)), ScoreSettings(*map(_numpy, settings)),
                                ScoreOutputs(*map(_written, staged)))
    for out, written in zip(outputs, staged):
        if written is not out:
            out.copy_(written)


def _reduce_rows(metrics: Tensor, sink_in_top: Tensor, sink_fields: Tensor, sees_sink: Tensor) -> Reduced:
    batch, n_heads, _, n_groups, n_sizes, n_metrics = metrics.shape
    # NumPy's zeros are the cheaper calls for these small outputs; the tensors share their memory.
    shapes = ((batch, n_heads, n_groups, n_sizes, n_metrics), (n_heads, 2, n_sizes, n_metrics), (n_heads, 2, n_sizes),
              (n_heads, n_sizes, N_BINS), (n_heads, n_sizes), (batch, n_heads, sink_fields.shape[-1]))
    out = [np.zeros(shape, dtype=np.float64) for shape in shapes]
    _kernels().reduce.reduce_rows(metrics.numpy(), sink_in_top.numpy(), sink_fields.numpy(),
                                  sees_sink.contiguous().numpy(), TOP_GROUP, SINK_REMOVED, F_SCORE, *out)
    return Reduced(*map(torch.from_numpy, out))


def _tally(vote_of: Tensor, is_token: Tensor, start: Tensor, sink: Tensor, window: int) -> votes.Tally:
    batch, n_heads, n_pos = vote_of.shape
    out = [np.zeros(shape, dtype=np.int64) for shape in ((batch, n_heads, 3), (batch, n_heads, 3),
                                                         (batch, votes.n_blocks(n_pos), n_heads, 3))]
    _kernels().reduce.tally(*(_numpy(x) for x in (vote_of, is_token, start, sink)), window, votes.LABEL_BLOCK, *out)
    return votes.Tally(*map(torch.from_numpy, out))


def _vote_from_keys(*args: Any) -> None:
    _kernels().vote.vote_from_keys(*args)


def _check_and_vote_rows(*args: Any) -> None:
    _kernels().check.check_and_vote_rows(*args)


def _vote_from_logits(*args: Any) -> None:
    _kernels().vote.vote_from_logits(*args)


#: The compiled kernels (CPU tensors).
NUMBA = Backend(
    name="numba", upcast_rows=True, check_and_vote=_check_and_vote, sink_geometry=_sink_geometry,
    gram=_gram, score_vectors=_score_vectors, score_rows=_score_rows, reduce_rows=_reduce_rows,
    tally=_tally, from_keys=FromKeys(_vote_from_keys, _check_and_vote_rows, _vote_from_logits),
)
#: The torch twins (any device).
TORCH = Backend(
    name="torch", upcast_rows=False, check_and_vote=twin_check.check_and_vote,
    sink_geometry=twin_geometry.write_sink_geometry, gram=twin_geometry.tied_gram,
    score_vectors=twin_score.score_vectors, score_rows=twin_score.score_rows,
    reduce_rows=twin_reduce.reduce_rows, tally=votes.tally, from_keys=None,
)
