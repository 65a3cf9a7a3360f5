"""The same-host identity (ringlet._topology)."""

import json
import os
import shutil
import socket
import subprocess
import sys
import textwrap

import pytest

from ringlet._topology import HOST_ID_ENV, host_groups, host_id


def test_host_id_is_stable_within_a_host_and_printable():
    a, b = host_id({}), host_id({})
    assert a == b and len(a) == 16 and int(a, 16) >= 0


def test_another_process_on_this_host_gets_the_same_id():
    env = {k: v for k, v in os.environ.items() if k != HOST_ID_ENV}
    out = subprocess.run([sys.executable, "-c", "from ringlet._topology import host_id; "
                          "print(host_id())"], env=env, capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == host_id({})


def test_override_wins_and_bad_overrides_are_refused():
    assert host_id({HOST_ID_ENV: " node7 "}) == "node7"
    assert host_id({HOST_ID_ENV: ""}) == host_id({})
    with pytest.raises(ValueError, match=HOST_ID_ENV):
        host_id({HOST_ID_ENV: "x" * 65})
    with pytest.raises(ValueError, match=HOST_ID_ENV):
        host_id({HOST_ID_ENV: "a\nb"})


def test_machine_id_ignores_what_sets_hosts_apart_but_not_the_kernel():
    from ringlet._topology import machine_id

    env = {k: v for k, v in os.environ.items() if k != HOST_ID_ENV}
    here = machine_id(host_id({}))
    assert len(here) == 16 and int(here, 16) >= 0 and here != host_id({})
    # RINGLET_HOST_ID names a host for shared memory; the CPUs stay the machine's.
    code = ("from ringlet._topology import host_id, machine_id; "
            "print(host_id(), machine_id(host_id()))")
    forced = subprocess.run([sys.executable, "-c", code], env={**env, HOST_ID_ENV: "node7"},
                            capture_output=True, text=True, timeout=60, check=True)
    assert forced.stdout.split() == ["node7", here]
    if os.geteuid() != 0 or not shutil.which("unshare"):
        return
    # Another network and UTS namespace (a container, a test-bed host): another
    # host, the same machine.
    other = subprocess.run(["unshare", "--net", "--uts", sys.executable, "-c",
                            "import socket; socket.sethostname('elsewhere'); " + code],
                           env=env, capture_output=True, text=True, timeout=60)
    assert other.returncode == 0, other.stderr
    their_host, their_machine = other.stdout.split()
    assert their_host != host_id({}) and their_machine == here


def test_host_groups_orders_hosts_by_lowest_rank():
    assert host_groups(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]
    assert host_groups([]) == []


# ---- CPU binding (RINGLET_BIND) -------------------------------------------------------------
from ringlet._topology import BIND_ENV, bind_mode, cpu_digest, plan_binding  # noqa: E402

from _launchers import clean_env  # noqa: E402


def test_plan_binding_gives_each_rank_of_a_host_its_block():
    d = cpu_digest(range(8))
    hosts, pids, digests = ["a", "a", "a"], [10, 11, 12], [d, d, d]
    blocks = [plan_binding(r, hosts, pids, digests, range(8)) for r in range(3)]
    assert blocks == [[0, 1], [2, 3, 4], [5, 6, 7]]
    # Only the ranks of this host count, in rank order.
    assert plan_binding(2, ["a", "b", "a"], [10, 11, 12], [d] * 3, [3, 2]) == [3]
    assert plan_binding(0, ["a", "b", "a"], [10, 11, 12], [d] * 3, [3, 2]) == [2]


def test_plan_binding_leaves_alone_what_it_should():
    d, e = cpu_digest([0, 1]), cpu_digest([1])
    assert plan_binding(0, ["a", "b"], [1, 2], [d, d], [0, 1]) is None      # alone on its host
    assert plan_binding(0, ["a", "a"], [7, 7], [d, d], [0, 1]) is None      # threads of one process
    assert plan_binding(0, ["a", "a"], [1, 2], [d, e], [0, 1]) is None      # a launcher bound them
    assert plan_binding(0, ["a"] * 3, [1, 2, 3], [d] * 3, [0, 1]) is None   # more ranks than CPUs
    assert plan_binding(0, ["a", "a"], [0, 2], [d, d], [0, 1]) is None      # a pid unknown


def test_cpu_digest_ignores_order_and_tells_sets_apart():
    assert cpu_digest([3, 1, 2]) == cpu_digest([1, 2, 3])
    assert cpu_digest([1, 2]) != cpu_digest([1, 2, 3])


def test_bind_mode_values():
    assert bind_mode({}) == "auto"
    assert bind_mode({BIND_ENV: " None "}) == "none"
    with pytest.raises(ValueError, match="RINGLET_BIND must be one of auto, none, got 'core'"):
        bind_mode({BIND_ENV: "core"})


def test_bind_process_reaches_threads_started_before():
    code = textwrap.dedent("""
        import os, threading
        from ringlet._topology import bind_process
        seen, go = [], threading.Event()
        def worker():
            seen.append(threading.get_native_id()); go.wait(60)
        t = threading.Thread(target=worker); t.start()
        while not seen: pass
        cpu = min(os.sched_getaffinity(0))
        bind_process([cpu])
        print(sorted(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(seen[0])), cpu)
        go.set(); t.join()
    """)
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    cpu = int(out.stdout.split()[-1])
    assert out.stdout.strip() == f"[{cpu}] [{cpu}] {cpu}"


_AFFINITY_JOB = textwrap.dedent("""
    import json, os, ringlet
    from ringlet import _core
    before = sorted(os.sched_getaffinity(0))
    ringlet.init(timeout=60)
    during = sorted(os.sched_getaffinity(0))
    own = _core.get_tuning()["own_cpus"]
    rank = ringlet.get_rank()
    ringlet.barrier()
    ringlet.shutdown()
    after = sorted(os.sched_getaffinity(0))
    print("AFF", json.dumps([rank, before, during, after]), flush=True)
    print("OWN", json.dumps([rank, own, _core.get_tuning()["own_cpus"]]), flush=True)
""")


def _affinities(stdout):
    """{rank: (CPUs before init, while in the job, after shutdown)}"""
    rows = {}
    for line in stdout.splitlines():
        if "AFF " in line:
            rank, *sets = json.loads(line[line.index("AFF ") + 4:])
            rows[rank] = tuple(sets)
    return rows


def _own_cpus(stdout):
    """{rank: (the own_cpus knob in the job, after shutdown)}"""
    return {r: (a, b) for r, a, b in (json.loads(line[line.index("OWN ") + 4:])
                                      for line in stdout.splitlines() if "OWN " in line)}


def _two_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("CPU binding needs at least 2 CPUs to give 2 ranks blocks of their own")
    return cpus


@pytest.mark.parametrize("mode,transport", [("auto", "auto"), ("none", "auto"), ("auto", "tcp")])
def test_ringlet_run_binds_each_rank_to_its_block_and_restores_it(tmp_path, mode, transport):
    cpus = _two_cpus()
    script = tmp_path / "job.py"
    script.write_text(_AFFINITY_JOB)
    out = subprocess.run([sys.executable, "-m", "ringlet.run", "-n", "2", str(script)],
                         env=clean_env(RINGLET_BIND=mode, RINGLET_TRANSPORT=transport),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _affinities(out.stdout)
    assert sorted(rows) == [0, 1], out.stdout
    half = len(cpus) // 2
    bound = mode == "auto" and transport != "tcp"  # ranks over TCP alone stay unbound
    for r, (before, during, after) in rows.items():
        assert before == after == cpus, (r, rows)
        if bound:
            assert during == (cpus[:half] if r == 0 else cpus[half:]), (r, rows)
        else:
            assert during == cpus, (r, rows)
    # The wait policy's own_cpus (longer polls on a busy host) follows the binding.
    assert _own_cpus(out.stdout) == {0: (int(bound), 0), 1: (int(bound), 0)}, out.stdout


def _launch(tmp_path, job, envs, masks=None):
    """Run ``job`` as len(envs) ranks by the env contract, rank r with the extra
    variables envs[r] and, given masks, started on the CPUs masks[r] as a
    launcher that binds would; each rank's stdout."""
    script = tmp_path / "job.py"
    script.write_text(job)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for r, extra in enumerate(envs):
        env = clean_env(RANK=str(r), WORLD_SIZE=str(len(envs)), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), RINGLET_SECRET="bind-test-secret-0123456789",
                        **extra)
        pin = None if masks is None else (lambda m=set(masks[r]): os.sched_setaffinity(0, m))
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      preexec_fn=pin))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * len(envs), outs
    return outs


def _launch_bound(tmp_path, masks):
    """_AFFINITY_JOB as 2 ranks started with these CPU sets; their combined stdout."""
    envs = [{"LOCAL_RANK": str(r)} for r in range(len(masks))]
    return "".join(_launch(tmp_path, _AFFINITY_JOB, envs, masks))


_MACHINE_JOB = textwrap.dedent("""
    import json, os, ringlet
    from ringlet import _core
    ringlet.init(timeout=60)
    t = _core.get_tuning()
    print("MACHINE", json.dumps([ringlet.get_rank(), sorted(os.sched_getaffinity(0)),
                                 t["host_ranks"], t["spin_yield"]]), flush=True)
    ringlet.barrier()
    ringlet.shutdown()
""")


def test_ranks_of_one_machine_with_other_host_ids_never_share_a_block(tmp_path):
    # Two "hosts" (RINGLET_HOST_ID, as containers or the test bed's namespaces
    # have) of two ranks each on this one machine: binding and the wait policy
    # count all four.  Per host, each pair would take the same two blocks.
    cpus = _two_cpus()
    outs = _launch(tmp_path, _MACHINE_JOB,
                   [{"LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "RINGLET_HOST_ID": host}
                    for r, host in enumerate(["a", "a", "b", "b"])])
    rows = {r: (cp, n, y) for r, cp, n, y in (json.loads(line[line.index("MACHINE ") + 8:])
                                              for out in outs for line in out.splitlines()
                                              if "MACHINE " in line)}
    assert sorted(rows) == [0, 1, 2, 3], outs
    assert {n for _, n, _ in rows.values()} == {4}, rows
    assert {y for _, _, y in rows.values()} == {int(len(cpus) < 4)}, rows
    sets = [set(cp) for cp, _, _ in rows.values()]
    if len(cpus) < 4:
        assert all(s == set(cpus) for s in sets), rows  # more ranks than CPUs: none bound
    else:
        assert all(not (a & b) for i, a in enumerate(sets) for b in sets[i + 1:]), rows


def test_ranks_a_launcher_bound_keep_their_cpus(tmp_path):
    cpus = _two_cpus()
    out = _launch_bound(tmp_path, [cpus, [cpus[-1]]])  # rank 1 as a launcher's binding left it
    rows = _affinities(out)
    assert rows[0] == (cpus, cpus, cpus), rows
    assert rows[1] == ([cpus[-1]],) * 3, rows
    # Rank 0 may run on rank 1's CPU: neither owns its CPUs.
    assert _own_cpus(out) == {0: (0, 0), 1: (0, 0)}, out


def test_ranks_a_launcher_bound_apart_own_their_cpus(tmp_path):
    cpus = _two_cpus()
    out = _launch_bound(tmp_path, [[cpus[0]], [cpus[-1]]])  # mpirun --bind-to core
    rows = _affinities(out)
    assert rows == {0: ([cpus[0]],) * 3, 1: ([cpus[-1]],) * 3}, rows
    # Disjoint sets: each rank's busy-host polls are its own, as after RINGLET_BIND's binding,
    # and shutdown() resets the knob.
    assert _own_cpus(out) == {0: (1, 0), 1: (1, 0)}, out


def test_cpu_ranges_round_trip_and_ownership_needs_disjoint_known_sets():
    from ringlet._topology import cpu_ranges, owns_cpus, parse_cpu_ranges

    assert cpu_ranges([8, 0, 1, 2, 3, 10, 11]) == "0-3,8,10-11"
    assert cpu_ranges([]) == ""
    assert parse_cpu_ranges("0-3,8,10-11") == {0, 1, 2, 3, 8, 10, 11}
    for bad in ("", "a", "3-1", "-1", "0-99999999"):
        assert parse_cpu_ranges(bad) is None, bad
    hosts, pids = ["a", "a", "b"], [10, 11, 12]
    assert owns_cpus(0, hosts, pids, ["0-1", "2-3", "0-3"])  # rank 2 is on another host
    assert not owns_cpus(0, hosts, pids, ["0-2", "2-3", ""])  # CPU 2 shared
    assert not owns_cpus(0, hosts, pids, ["0-1", "", ""])  # rank 1's set unknown
    assert not owns_cpus(0, hosts, [10, 10, 12], ["0-1", "2-3", ""])  # threads of one process
    assert not owns_cpus(2, hosts, pids, ["0-1", "2-3", "0-3"])  # alone on its host


def test_env_choice_reads_one_of_its_values_and_names_the_variable_otherwise():
    from ringlet._envvars import choice

    modes = ("auto", "shm", "tcp")
    assert choice("RINGLET_X", modes, {}) == "auto"
    assert choice("RINGLET_X", modes, {"RINGLET_X": "  "}) == "auto"
    assert choice("RINGLET_X", modes, {"RINGLET_X": " TCP "}) == "tcp"
    with pytest.raises(ValueError, match=r"RINGLET_X must be one of auto, shm, tcp, got 'udp'"):
        choice("RINGLET_X", modes, {"RINGLET_X": "udp"})
