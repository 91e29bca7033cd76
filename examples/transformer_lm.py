"""A small character-level transformer language model on the Zen of Python (the text
ships with Python: `import this`), with gradient clipping, in one process.

    python examples/transformer_lm.py --steps 200
"""
import argparse
import contextlib
import io
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

ap = argparse.ArgumentParser()
ap.add_argument("--steps", type=int, default=200)
ap.add_argument("--batch-size", type=int, default=32)
ap.add_argument("--context", type=int, default=32)
ap.add_argument("--lr", type=float, default=3e-3)
ap.add_argument("--clip", type=float, default=0.5)
args = ap.parse_args()
torch.manual_seed(0)
torch.set_num_threads(1)

with contextlib.redirect_stdout(io.StringIO()):
    import this  # noqa: F401  (prints the Zen of Python when imported)
text = "".join(this.d.get(c, c) for c in this.s)
vocab = sorted(set(text))
data = torch.tensor([vocab.index(c) for c in text])


class TinyLM(nn.Module):
    def __init__(self, vocab_size, context, dim=64, layers=2, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.pos = nn.Parameter(torch.zeros(context, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.0, batch_first=True)
        self.blocks = nn.TransformerEncoder(layer, layers)
        self.head = nn.Linear(dim, vocab_size)
        self.register_buffer("mask", nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, idx):
        h = self.embed(idx) + self.pos[: idx.shape[1]]
        return self.head(self.blocks(h, mask=self.mask, is_causal=True))


def get_batch(gen):
    starts = torch.randint(0, len(data) - args.context - 1, (args.batch_size,), generator=gen)
    x = torch.stack([data[s: s + args.context] for s in starts])
    y = torch.stack([data[s + 1: s + args.context + 1] for s in starts])
    return x, y


model = TinyLM(len(vocab), args.context)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
gen = torch.Generator().manual_seed(1)

for step in range(args.steps):
    xb, yb = get_batch(gen)
    opt.zero_grad()
    loss = F.cross_entropy(model(xb).flatten(0, 1), yb.flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
    opt.step()

model.eval()
with torch.no_grad():
    starts = range(0, len(data) - args.context - 1, 7)  # fixed evaluation windows
    xe = torch.stack([data[s: s + args.context] for s in starts])
    ye = torch.stack([data[s + 1: s + args.context + 1] for s in starts])
    result = {"loss": F.cross_entropy(model(xe).flatten(0, 1), ye.flatten()).item()}
print("RESULT", json.dumps(result))
