import tempfile
from typing import NamedTuple

import torch
from torch.utils.data import default_collate
from transformers import Trainer, TrainingArguments

import todevice


class Features(NamedTuple):  # the Trainer's own mover rebuilds it as Features(generator): TypeError
    x: torch.Tensor
    mask: torch.Tensor


class TodeviceTrainer(Trainer):
    # Private, so it may change in a later transformers; every batch goes through it, and _prepare_inputs,
    # its caller, keeps its checks. Under DeepSpeed it also casts float inputs: pass move() that dtype=.
    def _prepare_input(self, data):
        return todevice.move(data, self.args.device)


class Regressor(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(8, 1)

    def forward(self, features, labels):
        todevice.check(features, labels, device=self.net.weight.device)
        return {"loss": torch.nn.functional.mse_loss(self.net(features.x * features.mask), labels)}


samples = [{"features": Features(torch.randn(8), torch.ones(8)), "labels": torch.randn(1)} for _ in range(64)]
with tempfile.TemporaryDirectory() as output_dir:
    args = TrainingArguments(
        output_dir, max_steps=4, per_device_train_batch_size=16, report_to="none", save_strategy="no"
    )
    trainer = TodeviceTrainer(Regressor(), args, train_dataset=samples, data_collator=default_collate)
    trainer.train()
print(f"{trainer.state.global_step} steps on {trainer.args.device}")
