"""One TCP bulk transfer between two emulated ranks, to measure a pair's payload rate.

Run as a script inside a rank's namespace (by `EmulatedNetwork.measure_pair`), never imported by
the library: it is started by path, so it imports nothing of shardshift (whose package imports
may be heavy) and starts in a few tens of milliseconds.

    python pair_probe.py recv ADDR NBYTES   # prints the port, then {"bytes", "first", "seconds"}
    python pair_probe.py send ADDR PORT NBYTES

The receiver times from the first received chunk to the last one and leaves that first chunk out
of the bytes counted: connection set-up and process start-up are not part of the rate.
"""

from __future__ import annotations

import json
import socket
import sys
import time

CHUNK = 1 << 20
TIMEOUT_S = 60.0


def receive(addr: str, nbytes: int) -> None:
    with socket.create_server((addr, 0)) as server:  # port 0: the kernel picks a free port
        server.settimeout(TIMEOUT_S)
        print(server.getsockname()[1], flush=True)
        conn, _ = server.accept()
    with conn:
        conn.settimeout(TIMEOUT_S)
        buf = bytearray(CHUNK)
        total = first = 0
        t_first = t_last = 0.0
        while total < nbytes:
            got = conn.recv_into(buf)
            if got == 0:
                raise SystemExit(f"sender closed after {total} of {nbytes} bytes")
            t_last = time.perf_counter()
            if total == 0:
                first, t_first = got, t_last
            total += got
    print(json.dumps({"bytes": total, "first": first, "seconds": t_last - t_first}), flush=True)


def send(addr: str, port: int, nbytes: int) -> None:
    payload = memoryview(bytes(CHUNK))
    with socket.create_connection((addr, port), timeout=TIMEOUT_S) as conn:
        left = nbytes
        while left > 0:
            step = min(left, CHUNK)
            conn.sendall(payload[:step])
            left -= step


def main(argv: list[str]) -> None:
    if len(argv) == 3 and argv[0] == "recv":
        receive(argv[1], int(argv[2]))
    elif len(argv) == 4 and argv[0] == "send":
        send(argv[1], int(argv[2]), int(argv[3]))
    else:
        raise SystemExit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
