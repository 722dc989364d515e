"""launcher.WorkerGroup.kill, the forced exit's path (a second Ctrl-C during start-up): it must
return whatever state the group is in, with every rank it started gone and reaped."""

from __future__ import annotations

import threading

from nanoserve.distributed.launcher import WorkerGroup
from nanoserve.distributed.rank import Topology
from tests.distributed.ports import rendezvous_port

HANG = 120  # seconds: only a hang takes this long (a kill of two ranks takes well under one)


def gone_within(call, timeout: float = HANG) -> bool:
    """Run `call` on a thread; True if it returned (a hang must fail the test, not stall the suite)."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(timeout)


def waiting_topology(world_size: int, ranks_per_node: int) -> Topology:
    """Node 0 of a group whose other nodes never come: its ranks wait at the rendezvous."""
    return Topology(
        world_size,
        ranks_per_node,
        0,
        "gloo",
        f"tcp://127.0.0.1:{rendezvous_port()}",
        "cpu",
        cpu_threads=1,
        tp_size=world_size,
    )


def test_kill_of_a_group_with_no_rank_to_start_returns():
    """Node 0 of two with one rank a node: rank 0 is the caller's own, so no process is started.
    kill() must return at once: waiting on no process at all blocked forever. (Not
    kill_every_rank here: it would also kill the ranks of any engine another test keeps.)"""
    group = WorkerGroup(waiting_topology(2, 1), print)
    assert group.processes == []
    assert gone_within(group.kill)


def test_kill_reaps_every_rank_it_started():
    """Two worker ranks of a start-up that cannot finish (the other node never comes), killed
    wherever they are: kill() SIGKILLs both and returns once both are reaped."""
    group = WorkerGroup(waiting_topology(4, 3), print)
    assert len(group.processes) == 2
    assert gone_within(group.kill)
    assert [p.exitcode for p in group.processes] == [-9, -9]
    assert group.wait(0)
