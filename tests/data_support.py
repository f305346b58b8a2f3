"""Datasets, samples and jobs for the DataLoader and distributed tests.

They live in a module of their own so that worker processes started with spawn or forkserver, and
torch.distributed processes, can import them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import todevice


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass
class Example:
    image: torch.Tensor
    label: int
    name: str


class DictData(Dataset[dict[str, Any]]):
    """Samples of ``fields`` small tensors, an int and a string."""

    def __init__(self, n: int = 23, fields: int = 5, fail_at: int | None = None) -> None:
        self.n, self.fields, self.fail_at = n, fields, fail_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.fail_at:
            raise ValueError(f"sample {i} is broken")
        gen = torch.Generator().manual_seed(i)
        sample: dict[str, Any] = {f"f{k}": torch.randn(3, generator=gen) for k in range(self.fields)}
        sample["ids"] = torch.arange(4) + i
        sample["mask"] = torch.rand(2, generator=gen) > 0.5
        sample["index"] = i
        sample["name"] = f"sample-{i}"
        return sample


class ImageData(Dataset[dict[str, Any]]):
    """Samples of a 12 KiB image and an int label: a batch of 8 images is over the coalescing limit."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"image": torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(i)), "label": i}


class PairData(Dataset[Pair]):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> Pair:
        return Pair(torch.full((2,), float(i)), torch.tensor(i))


class ExampleData(Dataset[Example]):
    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> Example:
        return Example(torch.full((2, 2), float(i)), i, f"e{i}")


class RaggedData(Dataset[torch.Tensor]):
    """Samples of different sizes: default_collate cannot stack them, a collate_fn of the user's can."""

    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.arange(float(i % 5 + 1))


def collate_examples(samples: list[Example]) -> Example:
    """A user's collate_fn for dataclass samples (default_collate has no rule for them)."""
    return Example(torch.stack([s.image for s in samples]), len(samples), ",".join(s.name for s in samples))


def collate_ragged(samples: list[torch.Tensor]) -> dict[str, Any]:
    """A user's collate_fn for samples of different sizes: a list, and the lengths."""
    return {"items": list(samples), "lengths": torch.tensor([len(s) for s in samples])}


# ---------------------------------------------------------------- the distributed job


class Regression(Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        gen = torch.Generator().manual_seed(i)
        x = torch.randn(8, generator=gen)
        return {"x": x, "y": x.sum(0, keepdim=True) * 0.5, "extra": [torch.randn(2, generator=gen) for _ in range(3)]}


def train(pipeline: str, rank: int, world: int) -> list[float]:
    """Two epochs of DDP training; 'plain' uses default_collate, 'todevice' collate() and prefetch()."""
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = Regression()
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    collate_fn = todevice.collate() if pipeline == "todevice" else None
    # A spawned process spawns its DataLoader workers too, each importing torch again, every epoch.
    # Forked, they start at once, and safely: a fork copies the calling thread only, and the workers
    # never touch the process group or the locks of gloo's threads; they collate CPU tensors on the
    # one thread the DataLoader gives each. Fork is also what torchrun's jobs get on Linux.
    loader = DataLoader(
        data, batch_size=8, sampler=sampler, num_workers=2, collate_fn=collate_fn, multiprocessing_context="fork"
    )
    batches: Any = todevice.prefetch(loader, "cpu") if pipeline == "todevice" else loader
    losses = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for batch in batches:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(batch["x"]), batch["y"]) + 0 * batch["extra"][0].sum()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    return losses


def ddp_job(rank: int, world: int, port: int, out_dir: str) -> None:
    """One process of the 2-process gloo run (torch.multiprocessing.spawn calls it)."""
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = {"plain": train("plain", rank, world), "todevice": train("todevice", rank, world)}
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
