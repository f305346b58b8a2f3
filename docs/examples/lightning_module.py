import dataclasses

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, TensorDataset, default_collate

import todevice


@dataclasses.dataclass(frozen=True)
class Batch:  # Lightning's own mover raises ValueError on a frozen dataclass
    x: torch.Tensor
    y: torch.Tensor


class Regressor(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return todevice.move(batch, device)  # handles every type, so no super() fallback

    def training_step(self, batch, batch_idx):
        todevice.check(batch, device=self.device)  # raises, naming any tensor left behind
        return torch.nn.functional.mse_loss(self.net(batch.x), batch.y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=16, collate_fn=lambda samples: Batch(*default_collate(samples)))
quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
trainer = pl.Trainer(accelerator="auto", devices=1, max_steps=4, **quiet)
trainer.fit(Regressor(), loader)
print(f"{trainer.global_step} steps on {trainer.strategy.root_device}")
