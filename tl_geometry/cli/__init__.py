"""The ``tl-geometry`` command: :func:`tl_geometry.cli.main.main` builds the parser and runs one
subcommand module (``analyze``, ``report``, ``ablation`` for ``ablate`` and ``prune``,
``capacity``); ``args`` holds the shared option types and checks."""
