"""``HeadAnalysis``: the per-(layer, head, N) result of :func:`tl_geometry.analyze_heads`.

Fields that outside code may rely on: ``n_values``; ``labels`` ([layer][head] of "Retriever" |
"Mixer" | "Reset"); ``vote_fractions`` [layer, head, 3] (current, sink, other); ``sink_mass``,
``sink_norm_ratio``, ``sink_cosine`` [layer, head]; ``precision``, ``recall``, ``f_score``,
``margin``, ``inversions`` [layer, head, n] of the top-N sets; ``random_f_score`` [layer, head, n].
Layer ``i`` of every array is model layer ``layers[i]``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from jaxtyping import Float, Int
from torch import Tensor

from .functional.bounds import REGIME_FIELDS
from .functional.separability import METRIC_NAMES
from .functional.sink import SINK_FIELDS
from .functional.taxonomy import CLASSES, VOTES, labels_from_votes, vote_fractions

#: Selection groups scored per (layer, head, N) (SPEC §3): the top-N set, the random baseline,
#: the top-N re-selected with the sink removed, and the top-N instances with the sink inside /
#: outside the set.
GROUPS = ("top", "random", "sink_removed", "sink_in", "sink_out")
#: Lower bounds of the top-N sets (SPEC §6): inversion certificates, certified regime bounds
#: (observed extremes) and the predicted envelope (typical values).
BOUND_KINDS = ("inversion", "certified", "predicted")
BOUND_METRICS = ("precision", "recall", "f_score")


@dataclass
class HeadAnalysis:
    """Geometric separability, sink diagnostics and taxonomy of every analysed head.

    ``scores[g, m, l, h, i]`` is the mean of metric ``METRIC_NAMES[m]`` for group ``GROUPS[g]``
    at layer ``layers[l]``, head ``h``, ``N = n_values[i]``; the named attributes
    (``precision``, ``random_f_score``, ``sink_in_f_score``, ...) are views of it.
    """

    layers: tuple[int, ...]
    n_values: Int[Tensor, " n"]
    scores: Float[Tensor, "group metric layer head n"]
    group_counts: Float[Tensor, "group layer head n"]
    sink: Float[Tensor, "field layer head"]
    vote_counts: Float[Tensor, "layer head 3"]
    metadata: dict[str, Any] = field(default_factory=dict)
    bounds: Float[Tensor, "kind bmetric layer head n"] | None = None
    """With ``analyze_heads(bounds=True)``: mean lower bounds ``[BOUND_KINDS, (P, R, F), ...]``."""
    regime: Float[Tensor, "rfield layer head"] | None = None
    """With ``bounds=True``: regime diagnostics ``[REGIME_FIELDS, layer, head]`` (SPEC §6c)."""

    # --- stable fields -------------------------------------------------------------------
    @property
    def labels(self) -> list[list[str]]:
        """Class of every head by plurality vote: ``labels[layer][head]`` (SPEC §5)."""
        return [[CLASSES[i] for i in row] for row in labels_from_votes(self.vote_counts).tolist()]

    @property
    def vote_fractions(self) -> Float[Tensor, "layer head 3"]:
        """Fractions of source-winner votes (current, sink, other); NaN for a head with none."""
        return vote_fractions(self.vote_counts)

    def _metric(self, group: str, metric: str) -> Tensor:
        return self.scores[GROUPS.index(group), METRIC_NAMES.index(metric)]

    def metric(self, name: str, group: str = "top") -> Float[Tensor, "layer head n"]:
        """``[layer, head, n]`` mean of ``name`` (one of METRIC_NAMES) for ``group`` (GROUPS)."""
        if group not in GROUPS or name not in METRIC_NAMES:
            raise KeyError(f"group must be one of {GROUPS} and name one of {METRIC_NAMES}.")
        return self._metric(group, name)

    def __getattr__(self, name: str) -> Tensor:
        # precision, random_f_score, sink_removed_margin, sink_in_recall, ... and sink_<field>.
        if name.startswith("_") or name in {f.name for f in fields(HeadAnalysis)}:
            raise AttributeError(name)
        if name.startswith("sink_") and name[5:] in SINK_FIELDS:
            return self.sink[SINK_FIELDS.index(name[5:])]
        for kind in BOUND_KINDS:  # inversion_f_score, certified_recall, predicted_precision, ...
            if name.startswith(kind + "_") and name[len(kind) + 1 :] in BOUND_METRICS:
                return self.bound(kind, name[len(kind) + 1 :])
        if name.startswith("regime_") and name[7:] in REGIME_FIELDS:
            if self.regime is None:
                raise AttributeError(f"{name}: run analyze_heads(..., bounds=True) for regime diagnostics.")
            return self.regime[REGIME_FIELDS.index(name[7:])]
        for group in sorted(GROUPS, key=len, reverse=True):
            prefix = "" if group == "top" else group + "_"
            if name.startswith(prefix) and name[len(prefix) :] in METRIC_NAMES:
                return self._metric(group, name[len(prefix) :])
        raise AttributeError(f"HeadAnalysis has no attribute {name!r}")

    def __dir__(self) -> list[str]:
        extra = [f"sink_{f}" for f in SINK_FIELDS] + [
            f"{k}_{m}" for k in BOUND_KINDS for m in BOUND_METRICS
        ] + [f"regime_{f}" for f in REGIME_FIELDS] + [
            ("" if g == "top" else g + "_") + m for g in GROUPS for m in METRIC_NAMES
        ]
        return sorted(set(super().__dir__()) | set(extra))

    def bound(self, kind: str, metric: str = "f_score") -> Float[Tensor, "layer head n"]:
        """Mean lower bound ``[layer, head, n]`` of ``kind`` (BOUND_KINDS) on ``metric`` (P, R, F)."""
        if self.bounds is None:
            raise AttributeError("No bounds: run analyze_heads(..., bounds=True).")
        if kind not in BOUND_KINDS or metric not in BOUND_METRICS:
            raise KeyError(f"kind must be one of {BOUND_KINDS} and metric one of {BOUND_METRICS}.")
        return self.bounds[BOUND_KINDS.index(kind), BOUND_METRICS.index(metric)]

    @property
    def certified_fraction(self) -> Float[Tensor, " n"]:
        """Fraction of heads whose every analysed query is certified (P̲ = R̲ = 1) at each N."""
        if self.bounds is None:  # not AttributeError: a property's would be masked by __getattr__
            raise ValueError("No bounds: run analyze_heads(..., bounds=True).")
        certified = (self.bound("certified", "precision") == 1) & (self.bound("certified", "recall") == 1)
        return certified.double().mean(dim=(0, 1))

    def best_n(self):
        """Per head, the N ≥ 2 with the largest measured F_N and the largest predicted envelope
        F̲_N (SPEC §6b: the theory predicts small N), as a ``DataFrame``."""
        import pandas as pd

        if self.bounds is None:
            raise ValueError("No bounds: run analyze_heads(..., bounds=True).")
        keep = self.n_values >= 2
        ns = self.n_values[keep]

        def arg(x: Tensor) -> Tensor:
            return ns[torch.nan_to_num(x[..., keep], nan=-1.0).argmax(-1)]

        measured, predicted = arg(self.f_score), arg(self.bound("predicted", "f_score"))
        layer_ids = torch.tensor(self.layers)[:, None].expand_as(measured)
        heads = torch.arange(self.n_heads)[None, :].expand_as(measured)
        return pd.DataFrame({
            "layer": layer_ids.flatten().numpy(), "head": heads.flatten().numpy(),
            "measured_best_n": measured.flatten().numpy(),
            "predicted_best_n": predicted.flatten().numpy(),
        })

    @property
    def sink_norm_ratio(self) -> Float[Tensor, "layer head"]:
        """κ = ‖v_sink‖ / mean_{j≠sink} ‖v_j‖ (SPEC §4)."""
        return self.sink[SINK_FIELDS.index("norm_ratio")]

    @property
    def sink_mass(self) -> Float[Tensor, "layer head"]:
        """Mean attention on the sink."""
        return self.sink[SINK_FIELDS.index("mass")]

    @property
    def sink_cosine(self) -> Float[Tensor, "layer head"]:
        """Mean signed cos(v_sink, v_j) over the other keys."""
        return self.sink[SINK_FIELDS.index("cosine")]

    @property
    def precision(self) -> Float[Tensor, "layer head n"]:
        return self._metric("top", "precision")

    @property
    def recall(self) -> Float[Tensor, "layer head n"]:
        return self._metric("top", "recall")

    @property
    def f_score(self) -> Float[Tensor, "layer head n"]:
        return self._metric("top", "f_score")

    @property
    def margin(self) -> Float[Tensor, "layer head n"]:
        return self._metric("top", "margin")

    @property
    def inversions(self) -> Float[Tensor, "layer head n"]:
        return self._metric("top", "inversions")

    @property
    def random_f_score(self) -> Float[Tensor, "layer head n"]:
        return self._metric("random", "f_score")

    @property
    def f_gain(self) -> Float[Tensor, "layer head n"]:
        """Top-N minus random F_N (SPEC §3)."""
        return self.f_score - self.random_f_score

    @property
    def n_layers(self) -> int:
        return len(self.layers)

    @property
    def n_heads(self) -> int:
        return self.scores.shape[3]

    # --- tables ----------------------------------------------------------------------------
    def _n_index(self, n: int) -> int:
        values = self.n_values.tolist()
        if n not in values:
            raise KeyError(f"N={n} was not analysed; n_values are {values}.")
        return values.index(n)

    def class_counts(self):
        """``pandas.DataFrame`` of the number of heads of each class per layer."""
        import pandas as pd

        rows = [{c: row.count(c) for c in CLASSES} for row in self.labels]
        return pd.DataFrame(rows, index=pd.Index(self.layers, name="layer"))

    def heads_table(self):
        """One row per (layer, head): label, vote fractions and sink diagnostics."""
        import pandas as pd

        fractions = self.vote_fractions
        rows = []
        for li, layer in enumerate(self.layers):
            for h in range(self.n_heads):
                row: dict[str, Any] = {"layer": layer, "head": h, "label": self.labels[li][h]}
                row.update({f"vote_{v}": float(fractions[li, h, i]) for i, v in enumerate(VOTES)})
                row.update({f"sink_{f}": float(self.sink[i, li, h]) for i, f in enumerate(SINK_FIELDS)})
                rows.append(row)
        return pd.DataFrame(rows)

    def to_pandas(self):
        """Long-form ``DataFrame``: one row per (layer, head, N, group) with the five metrics,
        the number of instances behind the mean, and the head's label, votes and sink figures."""
        import pandas as pd

        heads = self.heads_table()
        n_groups, _, n_layers, n_heads, n_n = self.scores.shape
        grid = torch.cartesian_prod(
            torch.arange(n_groups), torch.arange(n_layers), torch.arange(n_heads), torch.arange(n_n)
        )
        g, li, h, ni = grid.unbind(-1)
        frame = pd.DataFrame(
            {
                "layer": torch.tensor(self.layers)[li].numpy(),
                "head": h.numpy(),
                "n": self.n_values[ni].numpy(),
                "group": [GROUPS[i] for i in g.tolist()],
                **{m: self.scores[g, k, li, h, ni].numpy() for k, m in enumerate(METRIC_NAMES)},
                "count": self.group_counts[g, li, h, ni].numpy(),
            }
        )
        if self.bounds is not None:  # rows "bound_<kind>" with the lower bounds on P, R, F
            k, _, li, h, ni = (x.flatten() for x in torch.meshgrid(
                *(torch.arange(n) for n in (self.bounds.shape[0], 1, n_layers, n_heads, n_n)),
                indexing="ij"))
            rows = {
                "layer": torch.tensor(self.layers)[li].numpy(), "head": h.numpy(),
                "n": self.n_values[ni].numpy(), "group": [f"bound_{BOUND_KINDS[i]}" for i in k.tolist()],
            }
            for m, name in enumerate(BOUND_METRICS):
                rows[name] = self.bounds[k, m, li, h, ni].numpy()
            frame = pd.concat([frame, pd.DataFrame(rows)], ignore_index=True)
        return frame.merge(heads, on=["layer", "head"], how="left")

    def top(self, k: int = 10, *, by: str = "f_gain", n: int = 2, largest: bool = True):
        """The ``k`` heads with the largest (or smallest) ``by`` at ``N = n``.

        ``by`` is any ``[layer, head, n]`` attribute (``f_score``, ``f_gain``,
        ``sink_removed_f_score``, ...) or ``[layer, head]`` one (``sink_norm_ratio``, ...).
        """
        values = getattr(self, by)
        if not isinstance(values, Tensor) or values.shape[:2] != (self.n_layers, self.n_heads) or (
            values.ndim == 3 and (by.startswith("vote") or values.shape[2] != len(self.n_values))
        ):
            raise ValueError(f"top(by={by!r}): need a [layer, head] or [layer, head, n] field.")
        if values.ndim == 3:
            values = values[..., self._n_index(n)]
        flat = torch.nan_to_num(values.flatten(), nan=-torch.inf if largest else torch.inf)
        order = flat.argsort(descending=largest)[:k]
        table = self.heads_table()
        chosen = table.iloc[order.tolist()].copy()
        if by not in chosen.columns:
            chosen.insert(3, by, values.flatten()[order].numpy())
        return chosen.reset_index(drop=True)

    def summary(self, n_values: tuple[int, ...] = (2, 4, 8)) -> str:
        """Readable per-layer and per-head summary: classes, sink figures, F_N vs random."""
        shown = [n for n in n_values if n in self.n_values.tolist()]
        meta = self.metadata
        lines = [
            f"tl_geometry head analysis — model {meta.get('model_name', '?')}, "
            f"{meta.get('n_sequences', '?')} sequences × {meta.get('n_positions', '?')} positions, "
            f"queries={meta.get('queries')}, distance={meta.get('distance')}, space={meta.get('space')}",
            "N=1 is trivial for the Euclidean distance (F_1 = 1); the headline is N ≥ 2.",
            "",
        ]
        counts = self.class_counts()
        total = counts.sum()
        n_all = int(total.sum())
        lines.append(
            "Classes: " + ", ".join(f"{c} {int(total[c])} ({100 * total[c] / n_all:.1f}%)" for c in CLASSES)
        )
        fscore = {n: self.f_score[..., self._n_index(n)] for n in shown}
        rand = {n: self.random_f_score[..., self._n_index(n)] for n in shown}
        for n in shown:
            lines.append(
                f"  mean F_{n}: top-N {_nanmean(fscore[n]):.3f}  random {_nanmean(rand[n]):.3f}  "
                f"sink removed {_nanmean(self.sink_removed_f_score[..., self._n_index(n)]):.3f}"
            )
        if self.bounds is not None:
            frac = self.certified_fraction
            lines.append(
                "  heads certified (P̲ = R̲ = 1): "
                + ", ".join(f"N={n}: {100 * float(frac[self._n_index(n)]):.1f}%" for n in shown)
            )
            best = self.best_n()
            agree = (best.measured_best_n == best.predicted_best_n).mean()
            lines.append(f"  predicted best N ≥ 2 matches the measured one for {100 * agree:.1f}% of heads")
        lines.append("")
        header = f"{'layer':>5} {'head':>4} {'class':<9} {'cur/sink/oth':>14} {'α_sink':>6} {'κ':>6} {'cos':>6}"
        header += "".join(f" {'F' + str(n) + ' top/rnd':>13}" for n in shown)
        lines.append(header)
        fractions = self.vote_fractions
        for li, layer in enumerate(self.layers):
            for h in range(self.n_heads):
                fr = "/".join(f"{float(x):.2f}" for x in fractions[li, h])
                row = (
                    f"{layer:>5} {h:>4} {self.labels[li][h]:<9} {fr:>14} "
                    f"{float(self.sink_mass[li, h]):>6.3f} {float(self.sink_norm_ratio[li, h]):>6.3f} "
                    f"{float(self.sink_cosine[li, h]):>6.3f}"
                )
                row += "".join(
                    f" {float(fscore[n][li, h]):>6.3f}/{float(rand[n][li, h]):<6.3f}" for n in shown
                )
                lines.append(row)
        return "\n".join(lines)

    def __repr__(self) -> str:
        total = self.class_counts().sum()
        classes = ", ".join(f"{c}={int(total[c])}" for c in CLASSES)
        return (
            f"HeadAnalysis(layers={len(self.layers)}, heads={self.n_heads}, "
            f"n_values={self.n_values.tolist()}, {classes})"
        )

    # --- persistence -------------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        """Write the analysis to ``path`` (a ``torch.save`` file of tensors and JSON metadata)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": "tl_geometry.HeadAnalysis/1",
            "layers": list(self.layers),
            "n_values": self.n_values,
            "scores": self.scores,
            "group_counts": self.group_counts,
            "sink": self.sink,
            "vote_counts": self.vote_counts,
            "bounds": self.bounds,
            "regime": self.regime,
            "metadata": json.dumps(self.metadata),
        }
        torch.save(payload, path)
        return path

    @classmethod
    def load(cls, path: str | Path) -> HeadAnalysis:
        """Read an analysis written by :meth:`save` (bit-exact round trip)."""
        payload = torch.load(Path(path), weights_only=True)
        if payload.get("format") != "tl_geometry.HeadAnalysis/1":
            raise ValueError(f"{path} is not a saved tl_geometry HeadAnalysis.")
        return cls(
            layers=tuple(payload["layers"]),
            n_values=payload["n_values"],
            scores=payload["scores"],
            group_counts=payload["group_counts"],
            sink=payload["sink"],
            vote_counts=payload["vote_counts"],
            metadata=json.loads(payload["metadata"]),
            bounds=payload.get("bounds"),
            regime=payload.get("regime"),
        )


def _nanmean(x: Tensor) -> float:
    return float(x.nanmean()) if torch.isfinite(x).any() else float("nan")
