"""Per-head top-N policies: how many keys each query head keeps (SPEC §10, ours).

A :class:`TopNPolicy` maps every (layer, query head) of a model to an ``N``: under
:func:`~tl_geometry.capacity.top_n_attention` that head keeps each query's top-``N`` weights;
``N = 0`` (:data:`KEEP_ALL`) leaves it dense. It is made from a ``[layer, head]`` integer tensor,
a ``{(layer, head): N}`` dict or an analysis' certified budgets
(:func:`~tl_geometry.truncation_budgets`), and saved as JSON::

    {"format": "tl_geometry.TopNPolicy/1", "n_layers": 30, "n_heads": 9,
     "heads": [[0, 3, 8], [0, 4, 16], ...],      # [layer, head, N] of every sparsified head
     "metadata": {"eps": 0.05, ...}}             # free-form, JSON values

Heads missing from ``heads`` keep every key. Loading checks every entry (``ValueError`` naming
the problem) and the counts, at most :data:`MAX_LAYERS` × :data:`MAX_HEADS`, so a damaged or
hostile file cannot make it allocate gigabytes.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from ..result.budgets import DEFAULT_EPS, truncation_budgets
from ..result.io import writable_path

POLICY_FORMAT = "tl_geometry.TopNPolicy/1"
#: ``N`` of a head that keeps every key (it is not sparsified).
KEEP_ALL = 0
#: The largest ``N`` (the int64 ranks it is compared with); any ``N`` ≥ the keys keeps every key.
MAX_N = 2**63 - 1
#: The most layers and query heads per layer a policy may have: far above any model's, and a
#: bound on what a policy file can make the loader allocate (4096 × 4096 int64 = 128 MiB).
MAX_LAYERS = 4096
MAX_HEADS = 4096


def _index(value: Any, what: str) -> int:
    """``value`` as an int (bools, floats and strings refused), else a ``ValueError``."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}.")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r} ({type(value).__name__}).") from None


def _check_shape(n_layers: Any, n_heads: Any) -> tuple[int, int]:
    """``(n_layers, n_heads)`` as ints in ``1 … MAX_LAYERS`` / ``1 … MAX_HEADS``, checked before
    anything is allocated."""
    out = []
    for value, what, limit in (n_layers, "n_layers", MAX_LAYERS), (n_heads, "n_heads", MAX_HEADS):
        count = _index(value, what)
        if not 1 <= count <= limit:
            raise ValueError(f"{what} = {count}: a policy needs n_layers, n_heads ≥ 1 and at most "
                             f"{MAX_LAYERS} layers and {MAX_HEADS} heads per layer (far above any "
                             f"model's); give the model's counts, in this order, e.g. "
                             "TopNPolicy.uniform(n, model.cfg.n_layers, model.cfg.n_heads).")
        out.append(count)
    return out[0], out[1]


def _check_n(value: Any, what: str) -> int:
    """``value`` as an ``N`` in ``0 … MAX_N`` (0: every key)."""
    n = _index(value, what)
    if not 0 <= n <= MAX_N:
        raise ValueError(f"{what} = {n} is not a number of keys: N ≥ 1 keeps the top-N keys, "
                         f"N = {KEEP_ALL} keeps every key (the head is left dense).")
    return n


@dataclass(frozen=True, eq=False)
class TopNPolicy:
    """Keys kept per query by every query head: ``n[layer, head]`` (``0``: every key), stored
    as an int64 CPU copy; ``metadata`` is free-form JSON data (where it came from, ε, ...)."""

    n: Int[Tensor, "layer head"]
    metadata: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        n = self.n
        if not isinstance(n, Tensor) or n.ndim != 2 or n.is_floating_point() or n.dtype == torch.bool \
                or n.is_complex():
            what = f"a {n.dtype} tensor of shape {tuple(n.shape)}" if isinstance(n, Tensor) else type(n).__name__
            raise ValueError(f"a policy's n must be an integer [layer, head] tensor of keys kept per "
                             f"query (0: every key), got {what}.")
        if n.is_meta:
            raise ValueError("a policy's n is a meta tensor (no values); pass a tensor with data.")
        _check_shape(*n.shape)
        if n.numel() and int(n.min()) < 0:
            raise ValueError(f"a policy's n holds {int(n.min())}; N ≥ 1 keeps the top-N keys, "
                             f"N = {KEEP_ALL} keeps every key.")
        if not isinstance(self.metadata, dict):
            raise ValueError(f"metadata must be a dict, got a {type(self.metadata).__name__}.")
        object.__setattr__(self, "n", n.detach().to("cpu", torch.int64).clone())
        object.__setattr__(self, "metadata", dict(self.metadata))

    @classmethod
    def uniform(cls, n: int, n_layers: int, n_heads: int) -> TopNPolicy:
        """Every head of an ``n_layers × n_heads`` model keeps its top-``n`` keys (note the
        order: ``n`` first). Counts that are not ints in ``1 … 4096`` raise ``ValueError``."""
        n = _check_n(n, "n")
        n_layers, n_heads = _check_shape(n_layers, n_heads)
        return cls(torch.full((n_layers, n_heads), n, dtype=torch.int64), {"uniform": n})

    @classmethod
    def from_dict(cls, heads: Mapping[tuple[int, int], int], n_layers: int, n_heads: int,
                  metadata: dict[str, Any] | None = None) -> TopNPolicy:
        """``{(layer, head): N}``; every head not in ``heads`` keeps every key."""
        if not isinstance(heads, Mapping):
            raise ValueError(f"heads must be a {{(layer, head): N}} dict, got {type(heads).__name__}.")
        n_layers, n_heads = _check_shape(n_layers, n_heads)
        n = torch.zeros(n_layers, n_heads, dtype=torch.int64)
        for key, value in heads.items():
            if not isinstance(key, tuple) or len(key) != 2:
                raise ValueError(f"policy key {key!r} must be a (layer, head) pair.")
            layer, head = _index(key[0], f"layer of {key!r}"), _index(key[1], f"head of {key!r}")
            if not (0 <= layer < n_layers and 0 <= head < n_heads):
                raise ValueError(f"policy key {key!r} is not a head of a model with {n_layers} layers × "
                                 f"{n_heads} heads.")
            n[layer, head] = _check_n(value, f"N of {key!r}")
        return cls(n, metadata or {})

    @classmethod
    def from_budgets(cls, budgets: Int[Tensor, "layer head"], layers: Any, n_layers: int,
                     metadata: dict[str, Any] | None = None) -> TopNPolicy:
        """A model-wide policy from per-head budgets of the model layers ``layers`` (row ``i`` of
        ``budgets`` is layer ``layers[i]``, as :func:`~tl_geometry.truncation_budgets` returns
        them); layers not listed keep every key."""
        layers = [_index(x, "layers entry") for x in layers]
        if not isinstance(budgets, Tensor) or budgets.ndim != 2 or budgets.shape[0] != len(layers):
            shape = tuple(budgets.shape) if isinstance(budgets, Tensor) else type(budgets).__name__
            raise ValueError(f"budgets must be a [layer, head] tensor with one row per entry of layers "
                             f"({len(layers)}), got {shape}.")
        n_layers, _ = _check_shape(n_layers, budgets.shape[1])
        if any(not 0 <= x < n_layers for x in layers) or len(set(layers)) != len(layers):
            raise ValueError(f"layers {layers} must be distinct layers of a {n_layers}-layer model.")
        n = torch.zeros(n_layers, budgets.shape[1], dtype=torch.int64)
        n[torch.tensor(layers, dtype=torch.long)] = budgets.to("cpu", torch.int64)
        return cls(n, metadata or {})

    @classmethod
    def from_result(cls, result: Any, eps: float = DEFAULT_EPS, n_layers: int | None = None) -> TopNPolicy:
        """Every analysed head at its certified budget ``k_ε`` (:func:`~tl_geometry.truncation_budgets`;
        heads with none, and layers not analysed, keep every key). ``n_layers`` defaults to the
        last analysed layer + 1."""
        budgets = truncation_budgets(result, eps)
        layers = list(result.layers)
        n_layers = max(layers) + 1 if n_layers is None else n_layers
        return cls.from_budgets(budgets, layers, n_layers, {"eps": float(eps), "source": "truncation_budgets"})

    @property
    def n_layers(self) -> int:
        return self.n.shape[0]

    @property
    def n_heads(self) -> int:
        return self.n.shape[1]

    @property
    def mask(self) -> torch.Tensor:
        """``[layer, head]`` bool: the heads this policy sparsifies (``N ≥ 1``)."""
        return self.n > KEEP_ALL

    def to_dict(self) -> dict[tuple[int, int], int]:
        """``{(layer, head): N}`` of the sparsified heads (the others keep every key)."""
        return {(int(layer), int(head)): int(self.n[layer, head]) for layer, head in self.mask.nonzero().tolist()}

    def kept_keys(self, n_pos: int) -> float:
        """Mean keys a query keeps, over every head and the causal queries ``t = 0 … n_pos − 1``
        of an unpadded window: ``min(N, t + 1)`` per (head, query), ``t + 1`` for a dense head.
        The budget to match when comparing with a uniform ``N``."""
        n_pos = _index(n_pos, "n_pos")
        if n_pos < 1:
            raise ValueError(f"n_pos must be ≥ 1, got {n_pos}.")
        keys = torch.arange(1, n_pos + 1, dtype=torch.float64)  # |T_t| = t + 1
        limit = torch.where(self.mask, self.n, MAX_N).to(torch.float64)[..., None]
        return float(torch.minimum(limit, keys).mean())

    def to_json(self) -> str:
        """The policy as JSON (module docstring): only the sparsified heads are listed."""
        heads = [[layer, head, n] for (layer, head), n in self.to_dict().items()]
        try:
            return json.dumps({"format": POLICY_FORMAT, "n_layers": self.n_layers, "n_heads": self.n_heads,
                               "heads": heads, "metadata": self.metadata}, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"the policy's metadata cannot be written as JSON ({exc}); keep it to "
                             "str, int, finite float, bool, None, list and dict.") from None

    @classmethod
    def from_json(cls, text: str) -> TopNPolicy:
        """The policy :meth:`to_json` wrote; ``ValueError`` naming the problem otherwise."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("not a policy: its JSON nests too deeply to read (a policy file is a "
                             "flat object with a list of [layer, head, N] entries); write it with "
                             "TopNPolicy.save.") from None
        except (TypeError, ValueError) as exc:
            raise ValueError(f"not a policy: invalid JSON ({exc}).") from None
        if not isinstance(data, dict) or data.get("format") != POLICY_FORMAT:
            fmt = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ValueError(f"not a policy of format {POLICY_FORMAT!r} (got {fmt!r}).")
        n_layers, n_heads = _check_shape(data.get("n_layers"), data.get("n_heads"))
        heads = data.get("heads")
        if not isinstance(heads, list):
            raise ValueError("a policy's heads must be a list of [layer, head, N] entries.")
        mapping: dict[tuple[int, int], int] = {}
        for i, entry in enumerate(heads):
            if not isinstance(entry, list) or len(entry) != 3:
                raise ValueError(f"heads[{i}] = {entry!r} is not a [layer, head, N] entry.")
            key = (_index(entry[0], f"heads[{i}] layer"), _index(entry[1], f"heads[{i}] head"))
            if key in mapping:
                raise ValueError(f"heads[{i}]: head {key} is listed twice.")
            mapping[key] = _index(entry[2], f"heads[{i}] N")
        metadata = data.get("metadata", {})
        return cls.from_dict(mapping, n_layers, n_heads, metadata if isinstance(metadata, dict) else {})

    def save(self, path: str | Path) -> Path:
        """Write :meth:`to_json` to ``path`` (folders made as needed); returns the path.
        ``ValueError`` if ``path`` is a folder or lies under a file."""
        path = writable_path(Path(path), "policy.json")
        text = self.to_json() + "\n"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        return path

    @classmethod
    def load(cls, path: str | Path) -> TopNPolicy:
        """Read a policy written by :meth:`save` (errors name the file): ``ValueError`` for a
        folder or a file that is not a policy, ``FileNotFoundError`` if there is none."""
        path = Path(path)
        if path.is_dir():
            raise ValueError(f"{path}: is a folder, not a policy file; give the policy file inside "
                             f"it, e.g. {path / 'policy.json'}.")
        try:
            return cls.from_json(path.read_text(encoding="utf-8"))
        except ValueError as exc:  # UnicodeDecodeError too
            raise ValueError(f"{path}: {exc}") from None

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TopNPolicy):
            return NotImplemented
        return torch.equal(self.n, other.n) and self.metadata == other.metadata

    __hash__ = None  # type: ignore[assignment]  # mutable metadata: not hashable

    def __repr__(self) -> str:
        sparsified = self.n[self.mask]
        spread = (f"N {int(sparsified.min())}…{int(sparsified.max())}" if sparsified.numel() else "none")
        return (f"TopNPolicy({self.n_layers} layers × {self.n_heads} heads, {int(self.mask.sum())} "
                f"sparsified, {spread})")


def as_policy(n: Any, n_layers: int, n_heads: int) -> TopNPolicy:
    """A :class:`TopNPolicy` for a ``n_layers × n_heads`` model from a policy, a ``[layer, head]``
    integer tensor or a ``{(layer, head): N}`` dict, with its shape checked."""
    if isinstance(n, TopNPolicy):
        policy = n
    elif isinstance(n, Tensor):
        policy = TopNPolicy(n)
    elif isinstance(n, Mapping):
        policy = TopNPolicy.from_dict(n, n_layers, n_heads)
    else:
        raise ValueError(f"n must be an int, a TopNPolicy, a [layer, head] integer tensor or a "
                         f"{{(layer, head): N}} dict, got {type(n).__name__}.")
    if (policy.n_layers, policy.n_heads) != (n_layers, n_heads):
        raise ValueError(f"the policy is {policy.n_layers} layers × {policy.n_heads} heads; the model "
                         f"has {n_layers} × {n_heads}. Make one row per layer and one column per query head.")
    return policy
