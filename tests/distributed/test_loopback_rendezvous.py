"""A single host's ranks listen on loopback only (issue 52 row 6): rank 0's TCPStore, made as the
launcher makes it (own_rendezvous), and gloo's sockets. The store has no authentication, so any
host that reached it could write the rendezvous. Read from /proc: every TCP socket this process
listens on after the rendezvous is made, by the inode of its descriptor."""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from nanoserve import envs
from nanoserve.distributed import rank as rank_module
from nanoserve.distributed.launcher import LOCAL_RENDEZVOUS, loopback_interface, own_rendezvous
from nanoserve.distributed.rank import Topology

pytestmark = pytest.mark.skipif(
    not Path("/proc/net/tcp").exists() or not dist.is_available(),
    reason="needs Linux's /proc/net and torch.distributed",
)

LISTEN = "0A"  # the state column of /proc/net/tcp
HANG = timedelta(seconds=120)  # only a hang takes this long


def _address(hexadecimal: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """/proc/net/tcp{,6} print an address as 32-bit words in the host's byte order."""
    raw = bytes.fromhex(hexadecimal)
    if sys.byteorder == "little":
        raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(raw)


def listening_sockets() -> dict[int, tuple[str, int]]:
    """This process's listening TCP sockets: inode -> (address, port)."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not Path(table).exists():
            continue
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            inode = int(fields[9])
            if fields[3] == LISTEN and inode in inodes:
                address, port = fields[1].split(":")
                found[inode] = (_address(address), int(port, 16))
    return found


def is_loopback(address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


@pytest.fixture
def clean_environment(monkeypatch):
    """The socket interface variables unset, and restored afterwards (own_rendezvous sets them)."""
    for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.setenv(name, "")  # recorded, so that the value set below is undone
        monkeypatch.delenv(name)


def single_host_rendezvous():
    """own_rendezvous as WorkerGroup calls it for two ranks on one host: (port, rank 0's store)."""
    topology = own_rendezvous(
        Topology(2, 2, 0, "gloo", LOCAL_RENDEZVOUS, "cpu", cpu_threads=1, tp_size=2)
    )
    assert topology.store_rendezvous and topology.init_method != LOCAL_RENDEZVOUS
    port = int(topology.init_method.rsplit(":", 1)[1])
    return port, rank_module._master_stores.pop(topology.init_method)


def test_the_store_listens_on_loopback_only(clean_environment):
    before = listening_sockets()
    port, store = single_host_rendezvous()
    new = {inode: where for inode, where in listening_sockets().items() if inode not in before}
    assert port in {listened for _, listened in new.values()}, new
    assert all(is_loopback(address) for address, _ in new.values()), new
    # and it serves a rank that joins over loopback
    client = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=HANG)
    client.set("key", "value")
    assert store.get("key") == b"value"


def test_gloo_sockets_listen_on_loopback_only(clean_environment):
    before = listening_sockets()
    port, store = single_host_rendezvous()
    interface = loopback_interface()
    assert interface is not None
    assert envs.read("GLOO_SOCKET_IFNAME") == envs.read("NCCL_SOCKET_IFNAME") == interface
    stores = [store, dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=HANG)]
    groups: list = [None, None]

    def join(rank: int) -> None:  # both ranks' groups in this process: each waits for the other
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("gloo", stores[rank]), rank, 2, HANG)

    threads = [threading.Thread(target=join, args=(rank,), daemon=True) for rank in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(HANG.total_seconds())
    assert all(groups), "the two gloo ranks never connected"
    tensors = [torch.ones(4), torch.full((4,), 2.0)]
    works = [group.allreduce([tensor]) for group, tensor in zip(groups, tensors)]
    for work in works:
        work.wait()
    assert tensors[0].tolist() == tensors[1].tolist() == [3.0] * 4
    new = {inode: where for inode, where in listening_sockets().items() if inode not in before}
    assert len(new) >= 2, new  # the store's and gloo's own
    assert all(is_loopback(address) for address, _ in new.values()), new


def test_an_interface_the_user_chose_is_kept(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "")  # empty: unset
    envs.set_loopback_sockets_default("lo")
    assert envs.read("GLOO_SOCKET_IFNAME") == "eth7" and envs.read("NCCL_SOCKET_IFNAME") == "lo"
