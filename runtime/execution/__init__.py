"""The execution layer under ``Engine``: the dispatcher, the replica executors (inline,
local, external) and the ``EngineCore`` that runs a plugin on one rank.

Imports ``runtime.core``, ``runtime.transport``, ``runtime.parallel`` and (local mode)
``supervisor``; never ``workers`` nor ``models``. Importing it loads none of its modules.
"""
