"""Helpers of ``demos/reproduce.py``: the reproduction study of the paper's claims.

corpora       the two text corpora (WikiText-2 test; Python standard-library source)
protocol      the models, the study's sizes (full, quick) and the token windows of a corpus
study         runs the protocol (SPEC §8) on every model × corpus, the ablation and capacity
              studies; saves and reloads their results with how long they took
rules         the verdict rule, the runs of a study, the headline range of N, best N
intervals     SPEC §8: seeded bootstrap over windows, 95 % intervals, held / not held / undecided
separability  claim 1: top-N vs the value-shuffle null vs random subsets (F*_N)
sink          claims 2 and 3: the sink's value geometry; its paired effect on F_N
certificates  claim 4: the paper's regime envelope (SPEC §6b) against the measured F_N, our shell
              certificate (§6d) beside it; c_sink vs recall
taxonomy      claim 5: the head classes
ablation      claim 6: the ablation study's tables and its claim
capacity      claim 7: retrieval capacity under top-N attention
claims        the tuple of claims 1–5
layer_kinds   a model's global and local layers read as two runs (SPEC §8 (i))
sizes         every claim decided again per model, and how it moves with size
plots         the PNG figures (matplotlib, Agg)
document      the Markdown page: a claim's section, the verdicts, a tiny table formatter
"""
