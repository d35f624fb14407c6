"""The torch twins of the compiled kernels, for CUDA and every device numba does not serve: each
module the twin of the :mod:`..compiled` module of the same name, with the same arguments,
outputs and random stream; the tests hold each pair to 1e-9. Only :mod:`..backend` calls them.
"""
