"""Bad HetrainStrategy uses, each answered by a UserError that says what to do; prints
one line per case: `<case>: <message>` (a one-worker job, plain python)."""
import lightning as L
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from hetrain.errors import UserError
from hetrain.lightning import HetrainStrategy


class Tiny(L.LightningModule):
    def __init__(self, data):
        super().__init__()
        self.net, self.data = torch.nn.Linear(4, 2), data

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.cross_entropy(self(x), y)

    def train_dataloader(self):
        return self.data

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Stream(IterableDataset):
    def __iter__(self):
        yield from ((torch.zeros(4), torch.tensor(0)) for _ in range(8))


loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
cases = {
    "global_batch": lambda: HetrainStrategy(global_batch=0),
    "balance": lambda: HetrainStrategy(balance="fast"),
    "accumulate": lambda: L.Trainer(strategy=HetrainStrategy(), accumulate_grad_batches=2, max_epochs=1,
                                    logger=False, enable_checkpointing=False).fit(Tiny(loader)),
    "sync_batchnorm": lambda: L.Trainer(strategy="hetrain", sync_batchnorm=True, max_epochs=1, logger=False,
                                        enable_checkpointing=False).fit(Tiny(loader)),
    "iterable": lambda: L.Trainer(strategy="hetrain", max_epochs=1, logger=False,
                                  enable_checkpointing=False).fit(Tiny(DataLoader(Stream(), batch_size=4))),
}
for name, case in cases.items():
    try:
        case()
        print(f"{name}: no error", flush=True)
    except UserError as err:
        print(f"{name}: {err}", flush=True)
