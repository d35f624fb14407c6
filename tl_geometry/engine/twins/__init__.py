"""The torch twins of the compiled kernels, for CUDA and every device numba does not serve.

One module per role, each the twin of the :mod:`..compiled` module of the same name: ``check``
(validation and votes from the rows), ``geometry`` (the sink geometry), ``score``
(every selection's scores) with ``order`` (the seeded selections it scores), ``reduce`` (the
reduction over queries). Same arguments, outputs and random stream as the kernels, on tensors
of any device; the tests hold each pair to 1e-9. Only :mod:`..backend` calls them.
"""
