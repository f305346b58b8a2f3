import dataclasses

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset, default_collate

import todevice


@dataclasses.dataclass
class Batch:  # accelerate's send_to_device hands a dataclass back unmoved
    x: torch.Tensor
    y: torch.Tensor


accelerator = Accelerator()  # not device_placement=False: that would keep the model off the device too
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
loader = DataLoader(data, batch_size=16, collate_fn=lambda samples: Batch(*default_collate(samples)))
model = torch.nn.Linear(8, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = accelerator.prepare(model, optimizer)
# Shards the batches across processes under `accelerate launch` too, but leaves their moving to todevice.
loader = accelerator.prepare_data_loader(loader, device_placement=False)

# move() in the loop rather than prefetch(): the loader tells accelerate when it reaches its last
# batch, for accumulate() and gather_for_metrics(), and reading ahead would tell it too early.
for batch in loader:
    batch = todevice.move(batch, accelerator.device)
    todevice.check(batch, device=accelerator.device)
    loss = torch.nn.functional.mse_loss(model(batch.x), batch.y)
    optimizer.zero_grad()
    accelerator.backward(loss)
    optimizer.step()
accelerator.print(f"{len(loader)} steps on {batch.x.device}")
