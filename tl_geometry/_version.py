"""The version of tl_geometry, in one place (read by the package root and the engine's metadata)."""

__version__ = "0.1.0"
