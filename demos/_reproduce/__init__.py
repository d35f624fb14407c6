"""Helpers of ``demos/reproduce.py``: the reproduction study of the paper's six claims.

corpora   the two text corpora (WikiText-2 test; Python standard-library source)
study     runs the protocol (SPEC §8) on every model × corpus and the ablation study
claims    one function per claim: measures, tables, verdict rule and verdict
plots     the PNG figures (matplotlib, Agg)
document  the Markdown page (a tiny table formatter, no tabulate)
"""
