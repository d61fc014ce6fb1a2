"""Severing a process's connections to its peers, so that whatever it waits for on them fails now.

gloo cannot cancel a collective or a transfer once it is posted (its ``abort`` does nothing): a
rank blocked on a peer that will never answer waits for the group's timeout. But gloo's pairs are
TCP connections, and a pair whose socket is shut down fails every operation pending on it at
once, on both ends ("Connection closed by peer"), as when the peer's process exits. So a process
that knows its world is broken (a peer was lost) leaves it at once by shutting down its own
established TCP connections, all but those it still needs: its long-lived clients of the job's
store, kept by socket (`store_sockets`, `sever_connections(keep_sockets=...)`) or by their remote
address. A store client made for one rendezvous is not kept: a rendezvous waiting on a peer that
will never come fails as well. The sockets stay open (gloo owns the descriptors and closes them
when its groups are destroyed); only the connections end.

This reads the process's sockets from ``/proc`` (Linux). On NCCL the same role is played by
aborting the communicators (``torch.distributed.distributed_c10d._abort_process_group``, or
``shrink_group`` with ``SHRINK_ABORT``); see docs/elastic.md.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Iterable

_ESTABLISHED = "01"  # /proc/net/tcp's state column


def _remote_endpoints() -> dict[int, tuple[str, int]]:
    """Socket inode -> (remote address, remote port) of this process's established TCP connections."""
    out = {}
    for table, family in (("tcp", 4), ("tcp6", 6)):
        try:
            with open(f"/proc/self/net/{table}") as file:
                lines = file.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] != _ESTABLISHED:
                continue
            address, port = fields[2].split(":")
            out[int(fields[9])] = (_address(address, family), int(port, 16))
    return out


def _address(hex_address: str, family: int) -> str:
    """An address as /proc/net/tcp{,6} writes it (each 32-bit word in host order), in the usual form."""
    raw = bytes.fromhex(hex_address)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    address = ipaddress.ip_address(words)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return str(address)


def connections(keep: Iterable[tuple[str, int]] = (), keep_sockets: Iterable[int] = ()) -> list[int]:
    """The file descriptors of this process's established TCP connections, but those whose remote
    end is one of `keep` ((address, port) pairs; a host name is resolved) and the sockets (inodes)
    of `keep_sockets`."""
    kept = {(_resolved(host), port) for host, port in keep}
    kept_sockets = set(keep_sockets)
    return [fd for fd, (inode, remote) in _sockets(_remote_endpoints()).items()
            if remote not in kept and inode not in kept_sockets]


def store_sockets(address: tuple[str, int]) -> frozenset[int]:
    """The sockets (inodes) of this process's established connections to `address` now: the store
    clients to keep when the others are severed."""
    remote = (_resolved(address[0]), address[1])
    return frozenset(inode for inode, end in _sockets(_remote_endpoints()).values() if end == remote)


def _sockets(endpoints: dict[int, tuple[str, int]]) -> dict[int, tuple[int, tuple[str, int]]]:
    """File descriptor -> (socket inode, remote end) of this process's descriptors among `endpoints`."""
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inode = int(target[len("socket:["):-1])
            if inode in endpoints:
                out[int(name)] = (inode, endpoints[inode])
    return out


def _resolved(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        return socket.gethostbyname(host)


def sever_connections(keep: Iterable[tuple[str, int]] = (), keep_sockets: Iterable[int] = ()) -> int:
    """Shut down every established TCP connection of this process but those to `keep` and those of
    `keep_sockets` (module docstring); the number shut down."""
    count = 0
    for fd in connections(keep, keep_sockets):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:  # closed meanwhile, or not a socket any more
            continue
        try:
            sock.shutdown(socket.SHUT_RDWR)
            count += 1
        except OSError:
            pass
        finally:
            sock.detach()  # the descriptor stays its owner's
    return count
