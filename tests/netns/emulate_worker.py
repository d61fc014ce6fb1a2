"""A rank for tests/netns/test_emulate.py, started by `python -m shardshift.netemu`.

Joins the group through the launch's file store, checks that gloo talks over the emulated
interface, all-reduces a small tensor, then times one send from rank 0 to rank 1 and prints
{"bytes", "seconds", "addr"} from rank 1.
"""

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from shardshift.runtime import init_distributed


def main(nbytes: int) -> None:
    init_distributed(timeout_s=120)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((5,), float(rank + 1))
    dist.all_reduce(x)
    assert x.tolist() == [world * (world + 1) / 2] * 5, x
    payload = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier()
    if rank == 0:
        dist.send(payload[: 1 << 16], dst=1)  # warm the connection up first
        dist.send(payload, dst=1)
    elif rank == 1:
        dist.recv(payload[: 1 << 16], src=0)
        start = time.perf_counter()
        dist.recv(payload, src=0)
        seconds = time.perf_counter() - start
        print(json.dumps({"bytes": nbytes, "seconds": seconds,
                          "addr": os.environ["SHARDSHIFT_ADDR"]}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]))
