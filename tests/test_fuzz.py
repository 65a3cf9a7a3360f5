"""The fuzz harnesses of fuzz/ replay their seed corpora and past finds.

CI fuzzes for a bounded time (fuzz/run.sh, with clang's libFuzzer and
atheris); these tests only replay the inputs kept in the repository
(fuzz/corpus/NAME: seeds, fuzz/regressions/NAME: reproducers of fixed bugs),
so they need neither clang nor atheris and run in seconds:

* the C harnesses (frame decoders, listener handshake) are built with gcc and
  fuzz/c/replay.c, under AddressSanitizer and UBSan where gcc has them;
* each Python harness's ``test_one_input`` runs on every file.

A harness raises (or aborts) only when its parser broke its contract, so
every replayed input is an assertion.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FUZZ = ROOT / "fuzz"
GCC = shutil.which("gcc")
C_HARNESSES = ["frame", "handshake"]
PY_HARNESSES = ["rpc_codec", "store", "pipeline", "checkpoint"]


def _inputs(name: str) -> list[Path]:
    files = []
    for d in (FUZZ / "corpus" / name, FUZZ / "regressions" / name):
        if d.is_dir():
            files += sorted(p for p in d.iterdir() if p.is_file())
    return files


def test_every_harness_has_seeds():
    names = {p.name for p in (FUZZ / "corpus").iterdir()}
    assert names == set(C_HARNESSES) | set(PY_HARNESSES)
    for name in names:
        assert len(_inputs(name)) >= 5, name


def _san_flags(tmp: Path) -> list[str]:
    """ASan + UBSan where this gcc can build and run a program with them."""
    flags = ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined",
             "-fno-omit-frame-pointer"]
    probe = tmp / "probe.c"
    probe.write_text("int main(void) { return 0; }\n")
    built = subprocess.run([GCC, *flags, str(probe), "-o", str(tmp / "probe")],
                           capture_output=True, timeout=120)
    if built.returncode != 0:
        return []
    ran = subprocess.run([str(tmp / "probe")], capture_output=True, timeout=60)
    return flags if ran.returncode == 0 else []


@pytest.fixture(scope="module")
def c_replayers(tmp_path_factory) -> dict:
    if GCC is None:
        pytest.skip("gcc is not installed")
    tmp = tmp_path_factory.mktemp("fuzz_c")
    flags = ["-g", "-O1", "-std=gnu11", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}",
             *_san_flags(tmp)]
    # The core is compiled once and linked into each harness.
    objs = tmp / "objs"
    objs.mkdir()
    srcs = sorted((ROOT / "csrc").glob("*.c")) + [FUZZ / "c" / "replay.c"]
    res = subprocess.run([GCC, *flags, "-c", *map(str, srcs)], cwd=objs, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    out = {}
    for name in C_HARNESSES:
        exe = tmp / f"replay_{name}"
        res = subprocess.run([GCC, *flags, str(FUZZ / "c" / f"{name}.c"),
                              *map(str, sorted(objs.glob("*.o"))), "-pthread", "-lm",
                              "-o", str(exe)], capture_output=True, text=True, timeout=300)
        assert res.returncode == 0, res.stderr
        out[name] = exe
    return out


@pytest.mark.parametrize("name", C_HARNESSES)
def test_c_harness_replays_corpus(c_replayers, name):
    files = _inputs(name)
    res = subprocess.run([str(c_replayers[name]), *map(str, files)], capture_output=True,
                         text=True, timeout=120,
                         env={"ASAN_OPTIONS": "detect_leaks=0", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"replayed {len(files)} inputs" in res.stdout
    assert "runtime error" not in res.stderr, res.stderr


def test_frame_seeds_are_accepted(c_replayers):
    """The frame seeds are recorded traffic: replayed, every op succeeds
    (except the seeds where rank 1 aborts), so the seeds stay deep."""
    files = [p for p in _inputs("frame") if p.parent.name == "frame"]
    res = subprocess.run([str(c_replayers["frame"]), *map(str, files)], capture_output=True,
                         text=True, timeout=120,
                         env={"ASAN_OPTIONS": "detect_leaks=0", "PATH": "/usr/bin:/bin",
                              "RINGLET_FUZZ_VERBOSE": "1"})
    assert res.returncode == 0, res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith("op ")]
    assert len(lines) == len(files)
    aborted = [ln for ln in lines if "peer aborted" in ln]
    ok = [ln for ln in lines if ": status 0 " in ln + " "]
    assert len(ok) + len(aborted) == len(files), res.stderr
    assert len(ok) >= len(files) - 6


def _load(name: str):
    path = FUZZ / "py" / f"fuzz_{name}.py"
    spec = importlib.util.spec_from_file_location(f"_fuzz_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("name", PY_HARNESSES)
def test_python_harness_replays_corpus(name):
    mod = _load(name)
    try:
        files = _inputs(name)
        for f in files:
            mod.test_one_input(f.read_bytes())
    finally:
        if hasattr(mod, "cleanup"):
            mod.cleanup()
    assert files


def test_python_harnesses_catch_a_broken_parser(monkeypatch):
    """A harness is only worth its CI minutes if it fails on a broken parser:
    make the RPC decoder leak an IndexError and the pipeline parser accept a
    huge declaration, and the seeds alone must expose both."""
    from ringlet.parallel.pipeline import _wire as rt
    from ringlet._wire import codec as ser

    rpc = _load("rpc_codec")

    def leaky(self, st):
        raise IndexError("planted")

    monkeypatch.setattr(ser._Decoder, "_unpack", leaky)
    with pytest.raises(IndexError):
        for f in _inputs("rpc_codec"):
            rpc.test_one_input(f.read_bytes())
    monkeypatch.undo()

    pipe = _load("pipeline")
    monkeypatch.setattr(rt, "_MAX_FRAME_BYTES", 1 << 80)
    with pytest.raises(AssertionError, match="declaration accepted"):
        for f in _inputs("pipeline"):
            pipe.test_one_input(f.read_bytes())
