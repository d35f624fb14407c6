"""Tables of a :class:`~tl_geometry.result.HeadAnalysis` (``pandas`` is imported on use)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ._result_schema import names

if TYPE_CHECKING:
    from .result import HeadAnalysis


def best_n(result: HeadAnalysis):
    """Per head, the N ≥ 2 with the largest measured F_N and the largest predicted envelope
    F̲_N (SPEC §6b: the theory predicts small N), as a ``DataFrame``."""
    import pandas as pd

    predicted_f = result.bound("predicted", "f_score")
    keep = result.n_values >= 2
    ns = result.n_values[keep]

    def arg(x: Tensor) -> Tensor:
        return ns[torch.nan_to_num(x[..., keep], nan=-1.0).argmax(-1)]

    measured, predicted = arg(result.f_score), arg(predicted_f)
    layer_ids = torch.tensor(result.layers)[:, None].expand_as(measured)
    heads = torch.arange(result.n_heads)[None, :].expand_as(measured)
    return pd.DataFrame({
        "layer": layer_ids.flatten().numpy(), "head": heads.flatten().numpy(),
        "measured_best_n": measured.flatten().numpy(),
        "predicted_best_n": predicted.flatten().numpy(),
    })


def heads_table(result: HeadAnalysis):
    """One row per (layer, head): label (``None`` for an unlabelled head, SPEC §5: a
    ``groupby("label")`` or ``value_counts()`` leaves it out), vote fractions (``vote_current``,
    ...) and sink diagnostics (``sink_mass``, ...)."""
    import pandas as pd

    per_head = {k: v for k, (v, has_n) in result.quantities().items()
                if not has_n and not k.startswith("regime_")}
    frame = pd.DataFrame({
        "layer": torch.tensor(result.layers).repeat_interleave(result.n_heads).numpy(),
        "head": torch.arange(result.n_heads).repeat(result.n_layers).numpy(),
        "label": [x for row in result.labels for x in row],
    })
    votes = [k for k in per_head if k.startswith("vote_")]  # votes first, as before
    for key in votes + [k for k in per_head if k not in votes]:
        frame[key] = per_head[key].flatten().double().numpy()
    return frame


def to_pandas(result: HeadAnalysis):
    """Long-form ``DataFrame``: one row per (layer, head, N, group) with the metrics, the
    number of instances behind the mean (``count``), and the head's label, votes and sink
    figures; with bounds, rows ``group="bound_<kind>"`` hold the lower bounds on P, R, F."""
    import pandas as pd

    n_layers, n_heads, n_n = result.n_layers, result.n_heads, len(result.n_values)
    li, h, ni = (x.flatten() for x in torch.meshgrid(
        torch.arange(n_layers), torch.arange(n_heads), torch.arange(n_n), indexing="ij"))
    coords = {"layer": torch.tensor(result.layers)[li].numpy(), "head": h.numpy(),
              "n": result.n_values[ni].numpy()}
    frames = [
        pd.DataFrame({**coords, "group": group,
                      **{m: result.metric(m, group).flatten().numpy() for m in names()["metric"]},
                      "count": result.count(group).flatten().numpy()})
        for group in names()["group"]
    ]
    if result.bounds is not None:
        frames += [
            pd.DataFrame({**coords, "group": f"bound_{kind}",
                          **{m: result.bound(kind, m).flatten().numpy() for m in names()["bound_metric"]}})
            for kind in names()["bound_kind"]
        ]
    frame = pd.concat(frames, ignore_index=True)
    return frame.merge(result.heads_table(), on=["layer", "head"], how="left")
