"""The "ringlet" torch.distributed backend: every op at 2 and 4 ranks, DDP, a futures comm
hook and FSDP2 against gloo and one process.  Jobs live in tests/torch_jobs/; each checks its
own results against expected values and prints "OK rank=R size=P"."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from test_torch_launch import _env, _torchrun  # noqa: E402

JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_jobs")


def _oks(out: str, P: int):
    return sorted(re.findall(rf"OK rank=\d+ size={P}", out))


def test_backend_ops_4_ranks_under_real_torchrun():
    out = subprocess.run([_torchrun(), "--standalone", "--nproc-per-node", "4",
                          os.path.join(JOBS, "backend_ops.py")],
                         env=_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert _oks(out.stdout, 4) == [f"OK rank={r} size=4" for r in range(4)]


def test_backend_ops_2_ranks_env_init():
    # env:// by hand (no torchrun): torch's rank 0 serves its TCPStore on MASTER_PORT,
    # ringlet's store goes on a port the OS picks, published through torch's store.
    for _attempt in range(3):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = []
        for r in range(2):
            env = _env()
            env.update(RANK=str(r), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            procs.append(subprocess.Popen([sys.executable, os.path.join(JOBS, "backend_ops.py")],
                                          env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True))
        outs = [p.communicate(timeout=180) for p in procs]
        if not any("Address already in use" in e for _, e in outs):
            break  # the port was taken between probe and bind (torch binds it): retry
    assert all(p.returncode == 0 for p in procs), [e[-4000:] for _, e in outs]
    assert _oks("".join(o for o, _ in outs), 2) == [f"OK rank={r} size=2" for r in range(2)]


def test_ddp_hook_fsdp2_match_gloo_and_one_process():
    out = subprocess.run([_torchrun(), "--standalone", "--nproc-per-node", "2",
                          os.path.join(JOBS, "ddp_fsdp.py")],
                         env=_env(), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert len(re.findall(r"OK rank=\d size=2 hook_calls=\d+", out.stdout)) == 2, out.stdout


def test_one_rank_world_makes_and_destroys_subgroups():
    # new_group in a world of one took a communicator id from a store that a world of
    # one does not have; destroy_process_group(group) left the ringlet group open.
    code = (
        "import torch, torch.distributed as dist\n"
        "import ringlet.torch\n"
        "dist.init_process_group('ringlet', rank=0, world_size=1, store=dist.HashStore())\n"
        "g = dist.new_group([0])\n"
        "t = torch.ones(3)\n"
        "dist.all_reduce(t, group=g)\n"
        "assert torch.all(t == 1)\n"
        "rg = g.ringlet_group\n"
        "dist.destroy_process_group(g)\n"
        "assert rg._closed, 'the subgroup is still open'\n"
        "t = torch.ones(2)\n"
        "dist.all_reduce(t)\n"
        "dist.destroy_process_group()\n"
        "print('OK one')\n")
    out = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "OK one" in out.stdout, out.stdout + out.stderr[-4000:]
