"""The TransformerLens 4.x side of the compatibility tests, run by the main environment's python.

    python tests/compat/bridge_reference.py OUT_DIR --n-seqs 3 --seq-len 40 --layers 0,14,29 \
        --analysis '{"n_values": [1, 2, 4, 8], "queries": "all", "random_samples": 4}'

Loads SmolLM2 as a ``TransformerBridge`` (``tl_geometry.load_model``) and writes to ``OUT_DIR``:
``bridge.pt`` with the token windows, the bridge's ``hook_pattern`` / ``hook_v`` of the listed
layers, its next-token log-probabilities and the TransformerLens version; and ``analysis.pt``,
``analyze_heads(cache, **analysis).save(...)``. The tests in the TransformerLens 3.x environment
rebuild the same inputs there and compare.
"""

from __future__ import annotations

import argparse
import json
import os
from importlib.metadata import version
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--n-seqs", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=40)
    parser.add_argument("--layers", default="0", help="comma-separated layers whose cache to save")
    parser.add_argument("--analysis", default="{}", help="analyze_heads keyword arguments (JSON)")
    args = parser.parse_args()

    import tl_geometry

    model = tl_geometry.load_model("smollm2-135m")
    tokens = tl_geometry.text_windows(model, n_seqs=args.n_seqs, seq_len=args.seq_len)
    with torch.no_grad():
        logits, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    tl_geometry.analyze_heads(cache, **json.loads(args.analysis)).save(args.out_dir / "analysis.pt")
    hooks = [f"blocks.{layer}.attn.{hook}" for layer in map(int, args.layers.split(","))
             for hook in ("hook_pattern", "hook_v")]
    torch.save(
        {
            "transformer_lens": version("transformer-lens"),
            "tokens": tokens,
            "log_probs": logits.log_softmax(-1),
            "cache": {name: cache[name] for name in hooks},
        },
        args.out_dir / "bridge.pt",
    )


if __name__ == "__main__":
    main()
