"""The same-host identity (ringlet._topology)."""

import os
import subprocess
import sys

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


def test_host_groups_orders_hosts_by_lowest_rank():
    assert host_groups(["b", "a", "b", "c", "a"]) == [[0, 2], [1, 4], [3]]
    assert host_groups([]) == []
