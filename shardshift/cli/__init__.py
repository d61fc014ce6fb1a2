"""The `shardshift` command line."""


def model_help(default: str) -> str:
    """What ``--model`` takes: the built-in models, family by family (`shardshift.models`)."""
    from shardshift.models.gpt.config import PRESETS as GPT
    from shardshift.models.llama.config import PRESETS as LLAMA
    from shardshift.models.moe.config import PRESETS as MOE

    families = "; ".join(f"{family}: {', '.join(sizes)}" for family, sizes in
                         (("a GPT", GPT), ("a Llama", LLAMA), ("a mixture of experts", MOE)))
    return (f"the model (docs/models.md), {families}; hf:DIR, a Hugging Face model's directory; or FILE.py:NAME "
            f"(or MODULE:NAME), a ModelSpec of your own (default {default})")


def add_device_argument(parser) -> None:
    """``--device``: where the ranks run (`shardshift.runtime.resolve_device`); `main` hands it to
    them in the environment, so ranks started by torchrun read the same variable."""
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                        help="auto (default): CUDA with NCCL when this host has a GPU for every local rank, else the "
                             "CPU with gloo")
