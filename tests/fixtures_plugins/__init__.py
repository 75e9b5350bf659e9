"""Importable stand-ins for third-party plugin packages (used by tests/test_plugins.py).

Nothing here registers itself on import: the tests resolve these classes through
``"tests.fixtures_plugins.thirdparty:Name"`` strings, in this process and in fresh
interpreters started from the repository root.
"""
