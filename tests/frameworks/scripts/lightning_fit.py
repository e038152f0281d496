"""A LightningModule under Trainer.fit (strategy="ddp" under torchrun, gloo)."""

import os

import pytorch_lightning as pl
import torch

from tests.frameworks.scripts import common

torch.manual_seed(0)


class Data(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4 * common.STEPS

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = common.batch(i, n=1)
        return x[0], y[0]


class Module(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = common.Net()
        common.poison(self.net.block)
        self.monitor = None

    def on_train_start(self) -> None:
        if common.EXPLICIT:  # Lightning steps with a closure: end the step after it
            import breakpod

            self.monitor = breakpod.watch(self, common.PARK_RULES)

    def on_before_optimizer_step(self, optimizer) -> None:
        if self.monitor is not None:
            self.monitor.step()  # backward is done, the update is not

    def training_step(self, batch, index):
        common.user_step(self.global_step)
        x, y = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


distributed = "WORLD_SIZE" in os.environ
trainer = pl.Trainer(
    max_steps=common.STEPS,
    accelerator="cpu",
    devices=int(os.environ.get("WORLD_SIZE", "1")),
    strategy="ddp" if distributed else "auto",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)
module = Module()
trainer.fit(module, torch.utils.data.DataLoader(Data(), batch_size=4))
common.finish(module)
