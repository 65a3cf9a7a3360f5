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


def pytest_sessionstart(session):
    # CI installs torch (CPU) on purpose: there its absence must fail the run, not
    # quietly skip the torch-oracle, gloo and torchrun tests.
    import os

    if os.environ.get("CI") == "true":
        try:
            importlib.import_module("torch")
        except ImportError as exc:
            raise pytest.UsageError(f"CI=true but torch is not installed ({exc}); .ci/run "
                                    f"installs torch==2.13.0+cpu first") from exc
