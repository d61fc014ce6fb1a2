"""A rank for tests/netns/test_collectives_emulated.py, started inside an emulated network.

Joins the default group with the `shardshift` backend (SHARDSHIFT_TOPOLOGY decides the topology;
the test sets `probe`), checks a few collectives against values computed locally, and rank 0
prints one JSON line: the backend name and the probed pair rates.
"""

import json

import torch
import torch.distributed as dist

from shardshift.collectives import register_backend
from shardshift.collectives.topology.model import pair_rates
from shardshift.runtime import init_distributed


def main() -> None:
    register_backend()
    init_distributed(timeout_s=120, backend="shardshift")
    rank, n = dist.get_rank(), dist.get_world_size()
    count = 300_001  # odd, about 1.2 MB of float32: several chunks per tree
    x = torch.arange(count, dtype=torch.float32) % 7 + rank
    dist.all_reduce(x)
    assert torch.equal(x, (torch.arange(count, dtype=torch.float32) % 7) * n + n * (n - 1) / 2)
    y = torch.full((count,), float(rank))
    dist.broadcast(y, src=n - 1)
    assert torch.equal(y, torch.full((count,), float(n - 1)))
    out = torch.empty(n * 1001, dtype=torch.int64)
    dist.all_gather_single(out, torch.full((1001,), rank, dtype=torch.int64))
    assert torch.equal(out, torch.arange(n).repeat_interleave(1001))
    dist.barrier()
    if rank == 0:
        group = dist.distributed_c10d._get_default_group()
        rates = pair_rates(group.topology)
        print(json.dumps({"backend": dist.get_backend(), "topology": group.topology.name,
                          "rates": [[u, v, r] for (u, v), r in sorted(rates.items())]}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
