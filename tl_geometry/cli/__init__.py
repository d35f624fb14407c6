"""The ``tl-geometry`` command (:mod:`tl_geometry.cli.main`); ``args`` holds the shared checks."""
