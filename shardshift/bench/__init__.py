"""Benchmarks: commands that print ratios measured side by side in one run (`shardshift bench ...`).

Each has a typed options dataclass that refuses bad input before any process starts, and a
function that runs it: `train` (tokens/s beside DDP), `switch` (the online switch beside DCP, a
restart and the physical limit; with ``--predict``, beside its time on a model of the machine that
`calibration` measures), `elastic` (changes of world in a running job beside restarts),
`packing` (tree packings beside their bounds), `collectives` (gloo, a ring, packed trees and `auto`
side by side, nccl-tests style; its ranks run `collectives_rank`), `data` (`data prepare` beside
tokenizers' own encoding, training from prepared shards beside the same ids in memory). `restart`
is the checkpoint-and-restart baseline that `switch` and `elastic` share. Multi-process
benchmarks start their ranks with `shardshift.launch`. With `plot`, rank 0 also draws the object
it reported (`shardshift.plots.bench`).
"""
