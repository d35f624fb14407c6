"""Text inputs: the built-in sample corpus and text → token windows that start as the model was
trained (with BOS only where it was trained with one)."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .facts import model_facts


def sample_text() -> str:
    """The built-in English corpus (written for this project; 61 paragraphs on varied topics)."""
    return files(__package__).joinpath("sample_text.txt").read_text(encoding="utf-8")


def read_text(path: str | Path) -> str:
    """A UTF-8 plain-text file's contents; ``ValueError`` naming the fix for a missing path, a
    folder, an unreadable, binary, non-UTF-8, empty or blank file."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"Text file {path} does not exist; pass the path of a UTF-8 plain-text file.")
    if not path.is_file():
        raise ValueError(f"Text file {path} is not a regular file (a folder?); pass a plain-text file.")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"Text file {path} cannot be read ({err.strerror}); check its permissions.") from err
    if b"\0" in data:
        raise ValueError(f"{path} looks binary (it holds NUL bytes), not plain text; pass a UTF-8 "
                         "text file (convert documents to .txt first).")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text (byte {err.start} cannot be decoded); convert it, "
                         f"e.g. iconv -f latin1 -t utf-8 {path}.") from err
    if not text.strip():
        raise ValueError(f"Text file {path} is {'empty' if not text else 'only whitespace'}; "
                         "pass a file with text in it.")
    return text


def text_windows(
    model_or_tokenizer: Any, text: str | None = None, *, n_seqs: int = 8, seq_len: int = 128
) -> Tensor:
    """``[n_seqs, seq_len]`` token windows of consecutive tokens of ``text``, each starting as the
    model was trained: with BOS only where it was trained with one (SPEC §1).

    The text (default: :func:`sample_text`) is tokenized once without special tokens and cut into
    non-overlapping windows: ``seq_len - 1`` tokens after BOS for a model trained with BOS
    (:func:`tl_geometry.inputs.models.trained_with_bos`), else ``seq_len`` text tokens.
    """
    tokenizer = getattr(model_or_tokenizer, "tokenizer", None) or model_or_tokenizer
    if n_seqs < 1 or seq_len < 2:
        raise ValueError(f"Need n_seqs ≥ 1 and seq_len ≥ 2, got {n_seqs} and {seq_len}.")
    bos = model_facts(model_or_tokenizer).bos_to_prepend()
    with_bos = bos is not None
    text = sample_text() if text is None else text
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = seq_len - 1 if with_bos else seq_len
    if len(ids) < n_seqs * body:
        start = f"BOS + {body}" if with_bos else f"{body} text tokens, no BOS"
        raise ValueError(f"The text has {len(ids)} tokens; {n_seqs} windows of {seq_len} ({start}) "
                         f"need {n_seqs * body}. Use fewer or shorter windows, or a longer text.")
    windows = torch.tensor(ids[: n_seqs * body], dtype=torch.long).reshape(n_seqs, body)
    if bos is None:
        return windows
    return torch.cat([torch.full((n_seqs, 1), bos, dtype=torch.long), windows], dim=1)
