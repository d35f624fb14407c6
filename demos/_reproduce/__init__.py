"""Helpers of ``demos/reproduce.py``: the reproduction study of the paper's six claims.

corpora   the two text corpora (WikiText-2 test; Python standard-library source)
protocol  the models, the study's sizes (full, quick) and the token windows of a corpus
study     runs the protocol (SPEC §8) on every model × corpus and the ablation study
ablation  claim 6: the ablation study's tables and its claim
claims    one function per claim 1–5: measures, tables, verdict rule and verdict
plots     the PNG figures (matplotlib, Agg)
document  the Markdown page: a claim's section, the verdicts, a tiny table formatter
"""
