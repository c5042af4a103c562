"""pytest setup for ``experiments/test_*.py`` (outside the default run: ``testpaths = ["tests"]``).

Run with ``python3 -m pytest experiments/test_fp8_ws.py``: the repository root (for ``dsv4`` and
``experiments``) and ``tests/`` (for ``kernel_helpers``) go on sys.path, and the GPU-skip hook and
CPU settings of ``tests/conftest.py`` apply here too.
"""
import importlib.util
import os
import sys

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [_REPO, os.path.join(_REPO, "tests")]

_spec = importlib.util.spec_from_file_location("_dsv4_tests_conftest", os.path.join(_REPO, "tests", "conftest.py"))
_tests_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_tests_conftest)
pytest_collection_modifyitems = _tests_conftest.pytest_collection_modifyitems
