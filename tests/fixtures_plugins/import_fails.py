"""A plugin module whose own dependency is missing: importing it raises ImportError."""

import phyrt_fixture_dependency_that_does_not_exist  # noqa: F401
