"""A pre-norm transformer encoder classifier: token embedding, (attention, FFN) x depth,
head. Attention sublayers are memory-bound layers, FFN sublayers dense ones, the token
embedding a sparse lookup. ``depth=99`` gives a 200-layer chain."""
from __future__ import annotations

import torch
from torch import nn

from .chain import ChainLayer, ChainModel


class TokenEmbedding(ChainLayer):
    kind = "sparse"

    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(seq, d))
        self.declared_rows = vocab

    def forward(self, ids):
        return (self.tok(ids) + self.pos[: ids.shape[1]],)


class AttentionSublayer(ChainLayer):
    kind = "memory"

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)

    def forward(self, x):
        h = self.norm(x)
        return (x + self.attn(h, h, h, need_weights=False)[0],)


class FFNSublayer(ChainLayer):
    kind = "dense"

    def __init__(self, d: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x):
        return (x + self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x)))),)


class ClassifierHead(ChainLayer):
    kind = "dense"

    def __init__(self, d: int, n_classes: int):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc = nn.Linear(d, n_classes)

    def forward(self, x):
        return (self.fc(self.norm(x).mean(dim=1)),)


class TransformerModel(ChainModel):
    def __init__(self, vocab: int = 32000, d: int = 256, heads: int = 4, depth: int = 6,
                 seq: int = 64, n_classes: int = 2):
        self.vocab, self.seq = vocab, seq
        layers: list[tuple[str, ChainLayer]] = [("embed", TokenEmbedding(vocab, d, seq))]
        for i in range(depth):
            layers.append((f"attn{i}", AttentionSublayer(d, heads)))
            layers.append((f"ffn{i}", FFNSublayer(d, 4 * d)))
        layers.append(("head", ClassifierHead(d, n_classes)))
        super().__init__(layers)

    def example_inputs(self, batch: int, generator: torch.Generator | None = None):
        return (torch.randint(0, self.vocab, (batch, self.seq), generator=generator),)

    def loss(self, output, target):
        return nn.functional.cross_entropy(output, target)
