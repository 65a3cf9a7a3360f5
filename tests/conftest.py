"""Shared pytest plumbing for ringlet's tests."""

from __future__ import annotations

import importlib
import shutil
import tempfile

import pytest

_TRACE_DIR = None


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

    # Jobs that fail on purpose dump their flight records (ringlet.trace), by
    # default into $TMPDIR, where hundreds a run would pile up: they go to one
    # directory that the session removes.
    if "RINGLET_TRACE_DIR" not in os.environ:
        global _TRACE_DIR
        _TRACE_DIR = tempfile.mkdtemp(prefix="ringlet-test-traces-")
        os.environ["RINGLET_TRACE_DIR"] = _TRACE_DIR

    if os.environ.get("CI") == "true":
        try:
            importlib.import_module("torch")
        except ImportError as exc:
            raise pytest.UsageError(f"CI=true but torch is not installed ({exc}); .ci/run "
                                    f"installs torch==2.13.0+cpu first") from exc


def pytest_sessionfinish(session, exitstatus):
    if _TRACE_DIR is not None:
        shutil.rmtree(_TRACE_DIR, ignore_errors=True)


def pytest_collection_finish(session):
    # When the ringlet under test is installed (CI), no test module may put the
    # checkout's uncompiled src/ on sys.path: spawned ranks inherit the path and
    # would import that tree instead, without its compiled core.
    import os
    import sys

    import ringlet

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    used = os.path.dirname(os.path.dirname(os.path.abspath(ringlet.__file__)))
    if os.path.realpath(used) != os.path.realpath(src):
        leaked = [p for p in sys.path if p and os.path.realpath(p) == os.path.realpath(src)]
        if leaked:
            raise pytest.UsageError(f"a test module put the checkout's {src} on sys.path while "
                                    f"the ringlet under test is {used}; import it conditionally")
