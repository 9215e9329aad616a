"""The README quickstart, as a project (tests/adoption/test_readme.py runs it)."""
