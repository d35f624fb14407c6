"""The edges that read the world: caches, offline model loaders and text.

``cache`` reads ``blocks.{l}.attn.hook_pattern`` / ``hook_v`` by name from any cache and raises
every "your cache is missing X" error; ``models`` loads the built-in and your own models offline;
``text`` holds the built-in sample text and cuts text into token windows with BOS.
"""
