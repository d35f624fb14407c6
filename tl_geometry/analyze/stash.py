"""Captured layers held until the sink is chosen (``sink="auto"`` on the recompute path): SPEC §1
chooses each window's sink from every layer before any layer can be analysed, so the one forward's
captures are kept and read back one layer at a time once the sink is known.
"""

from __future__ import annotations

import dataclasses
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

from ..inputs.capture import AttentionParams, LayerCapture

#: Bytes of captures kept in memory; the layers beyond go to a temporary folder (``TMPDIR``).
STASH_BYTES = 1 << 30


class CaptureStash:
    """Copies of captured layers, handed back in the order kept by :meth:`drain`.

        >>> stash = CaptureStash(budget=0)  # every layer to the temporary folder  # doctest: +SKIP
        >>> stash.keep(capture); [c.layer for c in stash.drain()]  # doctest: +SKIP
        [0]
    """

    def __init__(self, budget: int = STASH_BYTES) -> None:
        self.budget = budget
        self.held = 0  # bytes kept in memory
        self._kept: list[LayerCapture | Path] = []
        # What each layer on disk needs besides its tensors. Never a view of the forward's tensors:
        # even an empty view would keep their whole storage alive.
        self._on_disk: dict[Path, tuple[int, AttentionParams, torch.device]] = {}
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    def keep(self, capture: LayerCapture) -> None:
        """Keep a copy of ``capture`` (its tensors are views of the forward's own)."""
        tensors = (capture.q, capture.k, capture.v)
        size = sum(t.numel() * t.element_size() for t in tensors)
        # clone() keeps the strides, so the analysis reads the very same numbers in the same layout.
        q, k, v = (t.detach().clone() for t in tensors)
        if self.held + size <= self.budget:
            self.held += size
            # The log-sum-exp served the sink's choice, which is made before the layer comes back.
            self._kept.append(dataclasses.replace(capture, q=q, k=k, v=v, logsumexp=None))
            return
        if self._folder is None:
            self._folder = tempfile.TemporaryDirectory(prefix="tl_geometry-")
        path = Path(self._folder.name) / f"layer{capture.layer}-{len(self._kept)}.pt"
        torch.save({"q": q, "k": k, "v": v}, path)
        self._on_disk[path] = (capture.layer, capture.params, capture.q.device)
        self._kept.append(path)

    def drain(self) -> Iterator[LayerCapture]:
        """Every kept layer, in order, each dropped (or its file deleted) once handed over;
        the temporary folder is removed at the end, also on an error."""
        try:
            while self._kept:
                item = self._kept.pop(0)
                if isinstance(item, Path):
                    layer, params, device = self._on_disk.pop(item)
                    tensors = torch.load(item, map_location=device, weights_only=True)
                    item.unlink()
                    yield LayerCapture(layer, tensors["q"], tensors["k"], tensors["v"], params)
                else:
                    self.held -= sum(t.numel() * t.element_size() for t in (item.q, item.k, item.v))
                    yield item
        finally:
            self.close()

    def close(self) -> None:
        """Drop everything kept and remove the temporary folder."""
        self._kept.clear()
        self._on_disk.clear()
        self.held = 0
        if self._folder is not None:
            self._folder.cleanup()
            self._folder = None
