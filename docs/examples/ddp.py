# torchrun --nproc-per-node 2 docs/examples/ddp.py
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import todevice


def main():
    cuda = torch.cuda.is_available()
    local_rank = int(os.environ["LOCAL_RANK"])
    if cuda:
        # First: "cuda" with no index (move, prefetch, .to) means the current device; pin_memory and NCCL use it too.
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda" if cuda else "cpu")

    data = TensorDataset(torch.randn(256, 8), torch.randn(256, 1))
    sampler = DistributedSampler(data)
    loader = DataLoader(
        data, batch_size=32, sampler=sampler, num_workers=2, pin_memory=cuda, collate_fn=todevice.collate()
    )
    model = DistributedDataParallel(torch.nn.Linear(8, 1).to(device))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    for epoch in range(2):
        sampler.set_epoch(epoch)  # otherwise every epoch repeats the same order
        for x, y in todevice.prefetch(loader, device):
            loss = torch.nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    print(f"rank {dist.get_rank()}: {2 * len(loader)} steps on {x.device}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
