"""The torch twins of the compiled kernels (same arguments, outputs and random stream, on any
device; the tests hold each pair to 1e-9), each named as its :mod:`..compiled` module."""
