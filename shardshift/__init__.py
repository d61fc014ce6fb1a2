"""ShardShift: elastic multi-dimensional parallel training on PyTorch's distributed stack."""

__version__ = "0.1.0"
