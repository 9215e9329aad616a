"""The README quickstart, as a project (tests/acceptance/test_readme.py runs it)."""
