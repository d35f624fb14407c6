"""The compiled kernels of the engine (numba, CPU), one module per kernel, on NumPy views of the
tensors; their torch twins are in :mod:`..twins`, and only :mod:`..backend` calls either."""
