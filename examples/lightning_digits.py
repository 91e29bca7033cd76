"""An MLP on scikit-learn's handwritten digits with Lightning's Trainer and
HetrainStrategy: each worker's batch share follows its measured speed, gradients go
through hetrain's exchange (summation servers in mode byteps).

    hetrain launch --cluster examples/clusters/local.yaml examples/lightning_digits.py

Needs Lightning (`pip install 'hetrain[lightning]'`). The LightningModule and the
DataModule are plain Lightning; the strategy is the only hetrain line. On an emulated
cluster (a cluster file's `speed:` below 1), each CPU worker's forward pass is stretched
to its machine's speed with the demo's device model (`--cost-per-sample` seconds per
sample at speed 1), so the shares have speeds to follow.
"""
import argparse
from contextlib import nullcontext

import lightning as L  # slow imports before joining the job
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.demo.digits import load_digits_split
from hetrain.lightning import HetrainStrategy


class Digits(L.LightningDataModule):
    def __init__(self, batch_size: int):
        super().__init__()
        self.batch_size = batch_size

    def setup(self, stage):
        xtr, ytr, xte, yte = load_digits_split()
        self.train, self.test = TensorDataset(xtr, ytr), TensorDataset(xte, yte)

    def train_dataloader(self):  # per-device batch size, as for DDP: the global batch is it x the workers
        return DataLoader(self.train, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.test, batch_size=256)


class MLP(L.LightningModule):
    def __init__(self, lr: float, emulated: EmulatedDevice | None):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 64), nn.ReLU(), nn.Linear(64, 10))
        self.lr, self.emulated = lr, emulated

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with self.emulated.compute(len(x)) if self.emulated else nullcontext():
            loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss, batch_size=len(x))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        acc = (self(x).argmax(1) == y).float().mean()
        self.log("val_acc", acc, sync_dist=True, batch_size=len(x))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=16, help="per worker, as for DDP")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--cost-per-sample", type=float, default=0.0005,
                    help="emulated compute: seconds per sample at speed 1 (0: the real compute, stretched)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    strategy = HetrainStrategy()  # joins the job `hetrain launch` started (plain python: one worker)
    ctx = strategy.ctx
    machine = ctx.topology.proc(hetrain.rank()).machine if ctx.topology else None
    emulated = (EmulatedDevice(machine.device, machine.name, cost_per_sample=args.cost_per_sample or None)
                if machine and hetrain.device().type == "cpu" else None)
    trainer = L.Trainer(strategy=strategy, max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(MLP(args.lr, emulated), datamodule=Digits(args.batch_size))
    sampler = strategy.batch_sampler
    if trainer.is_global_zero:
        shares = ", ".join(f"{label} {int(n)}" for label, n in zip(sampler.group.labels or
                                                                  [f"w{i}" for i in range(hetrain.size())],
                                                                  sampler.sizes))
        print(f"val accuracy {float(trainer.callback_metrics['val_acc']):.3f}; "
              f"shares of the global batch of {sampler.sampler.global_batch}: {shares}", flush=True)


if __name__ == "__main__":
    main()
