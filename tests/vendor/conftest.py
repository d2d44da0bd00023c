"""DeepEP's vendored tests are run by tests/compat/test_deepep_own.py, not collected as they are."""

collect_ignore_glob = ["*.py"]
