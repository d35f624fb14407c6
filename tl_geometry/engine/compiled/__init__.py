"""The compiled kernels of the engine (numba, CPU), on NumPy arrays: one module per kernel, and
the argument types the engine calls them with (``signatures``). Their torch twins are in
:mod:`..twins`; only :mod:`..backend` calls either, through NumPy views of the tensors.
"""
