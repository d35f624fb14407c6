"""Token ids checked against the model before a forward: one check for every entry point."""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import Tensor


def embedding_rows(hf_model: Any) -> int | None:
    """Rows of a Hugging Face model's input embedding (its vocabulary), else ``None``."""
    get = getattr(hf_model, "get_input_embeddings", None)
    rows = getattr(get() if callable(get) else None, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def check_token_tensor(tokens: Any, name: str = "tokens", d_vocab: int | None = None, *, min_pos: int = 1,
                       layout: str | None = None, error: type[ValueError] = ValueError) -> Tensor:
    """``tokens`` once it is a ``[batch, pos]`` tensor of integer token ids holding at least one
    sequence of ``min_pos`` tokens, ids inside the vocabulary; else ``error`` naming ``name``, what
    it is and the fix. ``layout`` names the sequences the caller takes (e.g. ``"[batch, T]
    real-text token ids (T ≥ 4)"``) in the refusals of another type, shape or length."""
    if layout is not None and (not isinstance(tokens, Tensor) or tokens.ndim != 2):
        got = list(tokens.shape) if isinstance(tokens, Tensor) else type(tokens).__name__
        raise error(f"{name} must be {layout}, got {got}.")
    if not isinstance(tokens, Tensor):
        raise error(f"{name} must be a [batch, pos] tensor of token ids, got {type(tokens).__name__}; "
                    "e.g. torch.tensor([ids]) for one sequence, or tokenizer(texts, "
                    "return_tensors='pt').input_ids.")
    if tokens.ndim != 2:
        fix = " (one sequence: tokens[None])" if tokens.ndim == 1 else ""
        raise error(f"{name} must be [batch, pos] integer token ids, got shape {list(tokens.shape)}; "
                    f"add or drop the batch axis{fix}.")
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise error(f"{name} must be [batch, pos] integer token ids, got dtype {tokens.dtype}: pass "
                    "tokens.long() if they are whole numbers, or the tokenizer's ids.")
    if layout is not None and tokens.shape[0] < 1:
        raise error(f"{name} holds no sequences (shape {list(tokens.shape)}); pass at least one, {layout}.")
    if layout is not None and tokens.shape[1] < min_pos:
        raise error(f"{name} must be {layout}, got {list(tokens.shape)}.")
    if tokens.shape[0] < 1 or tokens.shape[1] < min_pos:
        raise error(f"{name} must hold at least one sequence of {min_pos} or more tokens, got shape "
                    f"{list(tokens.shape)}.")
    if tokens.is_meta:
        raise error(f"{name} is a meta tensor (shape {tuple(tokens.shape)}, no values); pass "
                    "real token ids, e.g. from tl_geometry.text_windows(model).")
    if tokens.numel() == 0:
        return tokens
    low, high = int(tokens.min()), int(tokens.max())  # d_vocab None: the sign only
    if low < 0 or (d_vocab is not None and high >= d_vocab):
        raise error(f"{name} hold token ids from {low} to {high}, outside the model's "
                    f"vocabulary [0, {d_vocab if d_vocab is not None else '…'}): were they "
                    "made by another tokenizer?")
    return tokens


def token_digest(tokens: Tensor, attention_mask: Tensor | None = None) -> str:
    """SHA-256 (hex, 16 characters) of the token ids, their shape and the mask: a cheap
    fingerprint a result records so that it is never paired with another batch's numbers."""
    digest = hashlib.sha256(repr(tuple(tokens.shape)).encode())
    digest.update(tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask).detach().to("cpu", torch.bool).contiguous()
        digest.update(b"mask")
        digest.update(mask.numpy().tobytes())
    return digest.hexdigest()[:16]
