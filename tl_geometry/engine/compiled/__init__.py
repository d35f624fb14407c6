"""The compiled kernels of the engine (numba, CPU), on NumPy arrays: one module per kernel.

``check`` (validation and votes from the rows), ``vote`` (votes from queries and keys),
``geometry`` (the sink geometry), ``score`` (every selection's scores, with the
stable ranking and seeded orders of ``order``), ``reduce`` (the reduction over queries),
``borrow`` (array views without reference counting, for the hot loops), and ``signatures`` (the
argument types the engine calls them with, all compiled at the first use). Their torch twins are
in :mod:`..twins`; only :mod:`..backend` calls either, through NumPy views of the tensors.
"""
