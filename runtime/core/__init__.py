"""The bottom floor: configs, errors, the plugin contract, futures, environment knobs.

Leaf subpackage: imports nothing of the project outside itself. Importing it loads no
module of it (torch-free callers import ``runtime.core.errors`` alone).
"""
