"""Severing a process's connections (`comm.sever`): every established TCP connection ends but those
to the addresses kept, the descriptors stay open, and a peer blocked reading sees the end at once."""

from __future__ import annotations

import socket
import threading
import time

from shardshift.comm.sever import connections, sever_connections, store_sockets


def _pair(server: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(server.getsockname())
    accepted, _ = server.accept()
    return client, accepted


def test_every_connection_ends_but_those_kept_and_a_blocked_reader_sees_it_at_once():
    with socket.create_server(("127.0.0.1", 0)) as kept_server, socket.create_server(("127.0.0.1", 0)) as server:
        kept_client, kept_accepted = _pair(kept_server)  # as a store client and its server
        client, accepted = _pair(server)  # as a gloo pair
        # Both ends of the kept connection are in this process (a store's client and its server are
        # not): keep each by its remote end. A host name is resolved.
        keep = [("localhost", kept_server.getsockname()[1]), kept_client.getsockname()]
        try:
            ours = set(connections(keep))
            assert client.fileno() in ours and accepted.fileno() in ours  # both ends live in this process
            assert kept_client.fileno() not in ours and kept_accepted.fileno() not in ours
            got = []
            reader = threading.Thread(target=lambda: got.append(client.recv(1)))
            reader.start()
            time.sleep(0.1)  # the reader blocks: nothing was sent
            assert sever_connections(keep) >= 2
            reader.join(timeout=5)
            assert got == [b""]  # the connection ended under the blocked reader
            assert client.fileno() >= 0 and accepted.fileno() >= 0  # the descriptors are still their owners'
            kept_client.sendall(b"x")
            assert kept_accepted.recv(1) == b"x"  # the kept connection still carries bytes
            assert not set(connections(keep)) & {client.fileno(), accepted.fileno()}  # no longer established
        finally:
            for s in (kept_client, kept_accepted, client, accepted):
                s.close()


def test_a_connection_to_the_kept_address_made_after_the_snapshot_is_severed():
    """The watch keeps the store clients a process has when it is armed (`store_sockets`); a client
    of the same store made later (a rendezvous's) is severed with the rest."""
    with socket.create_server(("127.0.0.1", 0)) as store_server:
        address = ("127.0.0.1", store_server.getsockname()[1])
        old_client, old_accepted = _pair(store_server)
        kept = store_sockets(address)
        new_client, new_accepted = _pair(store_server)
        # The store's end of the old client is in this process too (a real store's is not): keep it by
        # its remote end.
        keep = [old_client.getsockname()]
        try:
            assert len(kept) == 1
            ours = set(connections(keep, kept))
            assert new_client.fileno() in ours and old_client.fileno() not in ours
            sever_connections(keep, kept)
            assert new_client.recv(1) == b""  # ended
            old_client.sendall(b"x")
            assert old_accepted.recv(1) == b"x"  # still carries bytes
        finally:
            for s in (old_client, old_accepted, new_client, new_accepted):
                s.close()
