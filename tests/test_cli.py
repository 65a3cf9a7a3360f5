"""The release-facing CLI bits: ``ringlet --version``, ``ringlet info --json``, and
the one-line notice ``init()`` prints when no launcher is detected."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ringlet
from ringlet import _version, cli

from _launchers import clean_env, clear_launcher

ROOT = Path(__file__).resolve().parents[1]



def test_version_is_one_source():
    assert re.fullmatch(r"\d+\.\d+\.\d+([ab]|rc)?\d*(\.dev\d+)?", _version.__version__)
    assert ringlet.__version__ == _version.__version__
    # pyproject.toml takes it from _version.py rather than repeating it.
    pyproject = (ROOT / "pyproject.toml").read_text()
    dynamic = re.search(r'(?m)^dynamic\s*=\s*\[([^]]*)\]', pyproject)
    assert dynamic and '"version"' in dynamic.group(1)
    assert 'attr = "ringlet._version.__version__"' in pyproject
    assert not re.search(r'(?m)^version\s*=\s*"', pyproject)
    # CHANGELOG.md has a section for it.
    assert f"## {_version.__version__}" in (ROOT / "CHANGELOG.md").read_text()


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_flag(flag, capsys):
    assert cli.main([flag]) == 0
    assert capsys.readouterr().out == f"ringlet {ringlet.__version__}\n"


def test_version_flag_console_process():
    out = subprocess.run([sys.executable, "-m", "ringlet.cli", "--version"], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"ringlet {ringlet.__version__}"


def test_info_json(capsys, monkeypatch):
    clear_launcher(monkeypatch)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    monkeypatch.setenv("RINGLET_SECRET", "do-not-print-this-secret")
    assert cli.main(["info", "--json"]) == 0
    raw = capsys.readouterr().out
    assert "do-not-print-this-secret" not in raw
    d = json.loads(raw)
    assert d["version"] == ringlet.__version__
    assert d["python"] == "%d.%d.%d" % sys.version_info[:3]
    import numpy

    assert d["numpy"] == numpy.__version__
    assert d["launch"] == {"source": "torchrun", "rank": 1, "world_size": 3, "local_rank": 1,
                           "local_world_size": 3, "master_addr": "127.0.0.1",
                           "master_port": 29511}
    assert d["secret"] == "set"
    assert d["env"]["RANK"] == "1"
    assert d["core"]["protocol_version"] == ringlet._core.build_info()["protocol_version"]
    assert "simd" in d["core"]
    assert d["binding"] == {"mode": "auto", "cpus": sorted(os.sched_getaffinity(0))}


def test_info_names_the_binding_and_refuses_a_bad_one(capsys, monkeypatch):
    clear_launcher(monkeypatch)
    monkeypatch.setenv("RINGLET_BIND", "none")
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "cpu binding: none (CPUs left as the launcher set them)" in out
    assert f"this process may run on {cli._cpu_ranges(sorted(os.sched_getaffinity(0)))}" in out
    assert cli._cpu_ranges([0, 1, 2, 5, 7, 8]) == "CPUs 0-2,5,7-8"
    assert cli._cpu_ranges([3]) == "CPUs 3"
    monkeypatch.setenv("RINGLET_BIND", "cores")
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "RINGLET_BIND must be one of auto, none, got 'cores'" in d["binding"]["error"]


def test_info_json_without_launcher_and_invalid(capsys, monkeypatch):
    clear_launcher(monkeypatch)
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["launch"] is None and d["secret"] == "not set"
    monkeypatch.setenv("RANK", "x")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "ValueError" in d["launch"]["error"] and "RANK" in d["launch"]["error"]
    # The line form says the same.
    assert cli.main(["info"]) == 0
    assert "launch: invalid launcher environment (ValueError" in capsys.readouterr().out
    with pytest.raises(SystemExit) as ei:
        cli.main(["info", "--jsn"])
    assert ei.value.code == 2


_INIT = ("import ringlet; g = ringlet.init(timeout=30); "
         "print('world', ringlet.get_world_size()); ringlet.shutdown()")


def test_no_launcher_notice():
    out = subprocess.run([sys.executable, "-c", _INIT], env=clean_env(),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "world 1"
    notice = [ln for ln in out.stderr.splitlines() if "no launcher detected" in ln]
    assert len(notice) == 1, out.stderr
    assert "world of 1" in notice[0] and "RINGLET_QUIET=1" in notice[0]


def test_no_launcher_notice_quiet_and_launched():
    quiet = subprocess.run([sys.executable, "-c", _INIT], env=clean_env(RINGLET_QUIET="1"),
                           capture_output=True, text=True, timeout=60)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == "world 1"
    assert "no launcher" not in quiet.stderr
    # A launched rank (here explicit arguments, a world of one by choice) is not told.
    explicit = subprocess.run(
        [sys.executable, "-c", _INIT.replace("init(timeout=30)",
                                             "init(rank=0, world_size=1, timeout=30)")],
        env=clean_env(), capture_output=True, text=True, timeout=60)
    assert explicit.returncode == 0, explicit.stderr
    assert "no launcher" not in explicit.stderr
    launched = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "1", sys.executable,
                               "-c", _INIT], env=clean_env(), capture_output=True, text=True,
                              timeout=60)
    assert launched.returncode == 0, launched.stderr
    assert "no launcher" not in launched.stderr and "world 1" in launched.stdout


def test_info_says_whether_the_kernel_lets_ranks_copy_once(capsys, monkeypatch, tmp_path):
    from ringlet import _shm

    clear_launcher(monkeypatch)
    assert cli.main(["info", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["single_copy"] == {"yama_ptrace_scope": _shm.yama_ptrace_scope(), "ptracer": "none"}
    assert cli.main(["info"]) == 0
    assert ("single copy: " + _shm.single_copy_outlook(_shm.yama_ptrace_scope())
            in capsys.readouterr().out.splitlines())
    monkeypatch.setenv("RINGLET_PTRACER", "parent")
    assert cli.main(["info", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["single_copy"]["ptracer"] == "parent"
    monkeypatch.setenv("RINGLET_PTRACER", "all")
    assert cli.main(["info", "--json"]) == 0
    assert "RINGLET_PTRACER must be one of" in json.loads(capsys.readouterr().out)[
        "single_copy"]["error"]
    scope = tmp_path / "ptrace_scope"
    scope.write_text("1\n")
    assert _shm.yama_ptrace_scope(str(scope)) == 1
    assert _shm.yama_ptrace_scope(str(tmp_path / "absent")) is None
    scope.write_text("garbage")
    with pytest.raises(ValueError, match="not a number"):
        _shm.yama_ptrace_scope(str(scope))
    words = {s: _shm.single_copy_outlook(s) for s in (None, 0, 1, 2, 3)}
    assert "copied once" in words[None] and "copied once" in words[0]
    assert "staged" in words[1] and "kernel.yama.ptrace_scope=0" in words[1]
    assert "RINGLET_PTRACER=parent" in words[1]
    assert "CAP_SYS_PTRACE" in words[2] and "staged" in words[3]
    assert len(set(words.values())) == 5
    # The opt-in changes the words only where it acts: scope 1.
    assert all(_shm.single_copy_outlook(s, "parent") == words[s] for s in (None, 0, 2, 3))
    opted = _shm.single_copy_outlook(1, "parent")
    assert "RINGLET_PTRACER=parent" in opted and "copy large shared-memory messages once" in opted
