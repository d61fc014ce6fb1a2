"""The `shardshift` command line."""


def add_device_argument(parser) -> None:
    """``--device``: where the ranks run (`shardshift.runtime.resolve_device`); `main` hands it to
    them in the environment, so ranks started by torchrun read the same variable."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="auto (default): CUDA with NCCL when this host has a GPU for every local rank, else the "
                             "CPU with gloo")
