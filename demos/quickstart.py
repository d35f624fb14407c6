"""Quickstart: load SmolLM2 offline, cache only what is needed, analyse, and look at a few heads.

    python demos/quickstart.py [--n-seqs 4] [--seq-len 64]
"""

from __future__ import annotations

import argparse

import torch

import tl_geometry


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--n-seqs", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    args = parser.parse_args()

    model = tl_geometry.load_model("smollm2-135m")
    tokens = tl_geometry.text_windows(model, n_seqs=args.n_seqs, seq_len=args.seq_len)
    with torch.no_grad():
        _, cache = model.run_with_cache(tokens, names_filter=tl_geometry.CACHE_NAMES_FILTER)

    result = tl_geometry.analyze_heads(cache, n_values=(1, 2, 4, 8), model=model)
    print(result)
    print("\nHead classes per layer:\n", result.class_counts().T)
    print("\nHeads where the top-2 set beats random subsets the most:")
    print(result.top(5, by="f_gain", n=2)[["layer", "head", "label", "f_gain", "sink_mass"]])
    print("\nHeads with the smallest sink value norm (κ):")
    columns = ["layer", "head", "label", "sink_norm_ratio", "sink_cosine"]
    print(result.top(5, by="sink_norm_ratio", largest=False)[columns])
    frame = result.to_pandas()
    by_group = frame[frame.n == 2].groupby("group")["f_score"].mean()
    print("\nMean F_2 by selection group:\n", by_group)


if __name__ == "__main__":
    main()
