"""The inputs both TransformerLens lines analyse: the main suite's token windows, one setting."""

N_SEQS, SEQ_LEN = 3, 40
LAYERS = (0, 14, 29)  # whose raw hook_pattern / hook_v are compared tensor by tensor
ANALYSIS = {"n_values": [1, 2, 4, 8], "queries": "all", "random_samples": 4}
