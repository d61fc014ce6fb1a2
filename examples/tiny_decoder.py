import torch
import torch.nn.functional as F
from torch import nn

from shardshift.models import ModuleSpec


class Block(nn.Module):
    def __init__(self, hidden_size: int, n_heads: int):
        super().__init__()
        self.head_dim = hidden_size // n_heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden_size), nn.LayerNorm(hidden_size)
        self.q, self.k, self.v, self.o = (nn.Linear(hidden_size, hidden_size) for _ in range(4))
        self.up, self.down = nn.Linear(hidden_size, 4 * hidden_size), nn.Linear(4 * hidden_size, hidden_size)

    def forward(self, x):  # (batch, seq, hidden) -> the same; under tp, the heads this rank's q, k, v hold
        b, t, _ = x.shape
        q, k, v = (p(self.norm1(x)).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class TinyDecoder(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, n_heads: int, n_layers: int, seq_len: int):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab_size, hidden_size), nn.Embedding(seq_len, hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(hidden_size, n_heads) for i in range(n_layers)})
        self.norm, self.head = nn.LayerNorm(hidden_size), nn.Linear(hidden_size, vocab_size)

    def forward(self, x):  # token ids (batch, seq) -> logits (batch, seq, vocab); hidden states between stages
        if self.embed is not None:  # None on every pipeline stage but the first
            x = self.embed(x) + self.pos(torch.arange(x.shape[1], device=x.device))
        for layer in self.layers.values():
            x = layer(x)
        return x if self.head is None else self.head(self.norm(x))


spec = ModuleSpec(
    module=TinyDecoder, config=dict(vocab_size=256, hidden_size=32, n_heads=4, n_layers=5, seq_len=30),
    layers="layers", first=("embed", "pos"), last=("norm", "head"), tp_divides=("n_heads",),
    plan={"layers.*.q": "colwise", "layers.*.k": "colwise", "layers.*.v": "colwise", "layers.*.o": "rowwise",
          "layers.*.up": "colwise", "layers.*.down": "rowwise"},
)
