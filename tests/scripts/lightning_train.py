"""Train the reference model with Lightning's Trainer under HetrainStrategy for two
epochs (a last partial batch each) on emulated devices of the cluster file's speeds;
save the parameters, the shares used and each step's trained batch size.
--by-name: Trainer(strategy="hetrain") (Lightning's strategy registry). Run without the
launcher (`python lightning_train.py OUT`), it is a one-worker job at speed 1."""
import sys
from contextlib import nullcontext
from pathlib import Path

import lightning as L  # slow imports before joining the job
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hetrain
from hetrain.cluster.device import EmulatedDevice
from hetrain.lightning import HetrainStrategy

sys.path.insert(0, str(Path(__file__).parent))
from reference import GLOBAL_BATCH, data, make_model  # noqa: E402

EPOCHS = 2
COST = 0.01  # calibrated device model: 10 ms per sample at speed 1 (stable timing on a shared host)
out = Path(sys.argv[1])


class Reference(L.LightningModule):
    def __init__(self, emulated: EmulatedDevice | None):
        super().__init__()
        self.net = make_model()
        self.emulated = emulated
        self.trained: list[int] = []  # this worker's samples per step

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        with self.emulated.compute(len(x)) if self.emulated else nullcontext():
            loss = F.cross_entropy(self.net(x), y)
        self.trained.append(len(x))
        self.log("train_loss", loss, sync_dist=True, batch_size=len(x))
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y), sync_dist=True, batch_size=len(x))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class Data(L.LightningDataModule):
    """A standard data module: the per-device batch size DDP would use, shuffled."""

    def setup(self, stage):
        x, y = data()
        self.train, self.val = TensorDataset(x, y), TensorDataset(x[:40], y[:40])

    def train_dataloader(self):
        return DataLoader(self.train, batch_size=GLOBAL_BATCH // hetrain.size(), shuffle=True)

    def val_dataloader(self):
        return DataLoader(self.val, batch_size=10)


strategy = "hetrain" if "--by-name" in sys.argv else HetrainStrategy()
ctx = hetrain.init()
rank = hetrain.rank()
machine = ctx.topology.proc(rank).machine if ctx.topology else None
module = Reference(EmulatedDevice(machine.device, machine.name, cost_per_sample=COST) if machine else None)
trainer = L.Trainer(strategy=strategy, max_epochs=EPOCHS, logger=False,
                    default_root_dir=str(out / "lightning"), enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, datamodule=Data())
sampler = trainer.strategy.batch_sampler
out.mkdir(parents=True, exist_ok=True)
torch.save({"params": {k.removeprefix("net."): v.detach().cpu().clone() for k, v in module.state_dict().items()},
            "sizes": torch.tensor([list(s) for s in sampler.balancer.history]),
            "orders": [torch.from_numpy(sampler.sampler.order(e)) for e in range(EPOCHS)],
            "trained": torch.tensor(module.trained), "spreads": sampler.spreads,
            "rows": None if sampler.last_rows is None else torch.from_numpy(sampler.last_rows), "speed": module.emulated.last_speed if module.emulated else 1.0,
            "world": trainer.world_size, "global_step": trainer.global_step,
            "strategy": type(trainer.strategy).__name__,
            "val_loss": float(trainer.callback_metrics["val_loss"])}, out / f"rank{rank}.pt")
hetrain.shutdown()
