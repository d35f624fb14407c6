"""Synthetic attention caches with the hard cases: ties, duplicated vectors, a compressed sink
aligned against the rest, GQA / MQA shapes, half precision, left and right padding, sliding
windows."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Case:
    pattern: torch.Tensor  # [batch, head, query, key]
    v: torch.Tensor  # [batch, pos, kv_head, d]
    attention_mask: torch.Tensor | None  # [batch, pos] or None

    def cache(self, layer: int = 0) -> dict[str, torch.Tensor]:
        return {
            f"blocks.{layer}.attn.hook_pattern": self.pattern,
            f"blocks.{layer}.attn.hook_v": self.v,
        }


def make_case(
    seed: int,
    *,
    batch: int = 2,
    n_heads: int = 4,
    n_kv: int = 2,
    n_pos: int = 12,
    d: int = 5,
    ties: bool = False,
    duplicates: bool = False,
    sink: bool = False,
    padding: str | None = None,
    dtype: torch.dtype = torch.float32,
    window: int | None = None,
) -> Case:
    """A causal softmax pattern and value vectors with the requested pathologies; with
    ``window``, a sliding-window layer (query ``t`` sees keys ``t − window < i ≤ t``: every other
    weight is exactly 0)."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(batch, n_heads, n_pos, n_pos, generator=g) * 2
    if ties:  # few distinct logit levels → many exact attention ties in a row
        logits = logits.round()
    v = torch.randn(batch, n_pos, n_kv, d, generator=g)
    if duplicates:  # later keys copy earlier ones, with equal logits → identical contributions
        for src, dst in ((1, 3), (2, 5), (4, 7)):
            if dst < n_pos:
                v[:, dst] = v[:, src]
                logits[..., dst] = logits[..., src]
    if sink:  # small sink, pointing against the others, attended heavily
        v[:, 0] = -0.15 * v[:, 1:].mean(1) / v[:, 1:].mean(1).norm(dim=-1, keepdim=True).clamp_min(1e-6)
        logits[..., 0] += 3.0
    mask = None
    if padding is not None:
        lengths = torch.randint(max(2, n_pos // 2), n_pos + 1, (batch,), generator=g)
        lengths[0] = n_pos // 2  # at least one short sequence
        pos = torch.arange(n_pos)
        if padding == "right":
            mask = pos[None, :] < lengths[:, None]
        elif padding == "left":
            mask = pos[None, :] >= (n_pos - lengths)[:, None]
        else:
            raise ValueError(padding)
    causal = torch.ones(n_pos, n_pos, dtype=torch.bool).tril()
    if window is not None:
        causal = causal & ~torch.ones(n_pos, n_pos, dtype=torch.bool).tril(-window)
    allowed = causal if mask is None else causal & mask[:, None, None, :]
    pattern = torch.softmax(logits.masked_fill(~allowed, -torch.inf), dim=-1)
    # Fully masked rows (pad queries before the first real token) are NaN after softmax: keep
    # them, as a real padded forward pass can produce them.
    return Case(pattern.to(dtype), v.to(dtype), None if mask is None else mask.long())
