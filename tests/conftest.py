"""Shared pytest plumbing for ringlet's tests."""

from __future__ import annotations

import importlib

import pytest


def require(module: str):
    """Import a declared test dependency (pyproject's ``test`` extra).

    Missing one is a failure, never a skip: a skip would hide every test that
    needs it.  Install the extra with ``pip install -e '.[test]'``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        pytest.fail(f"{module} is a declared test dependency and is not installed ({exc}); "
                    f"pip install -e '.[test]'", pytrace=False)
