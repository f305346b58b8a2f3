import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import todevice


class Features(Dataset):  # 24 small features and a label a sample: a batch of 25 small tensors
    def __init__(self, steps):
        self.steps = steps

    def __len__(self):
        return 64 * self.steps

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {**{f"f{k}": torch.randn(8, generator=g) for k in range(24)}, "y": torch.randint(0, 4, (), generator=g)}


def timed(name, loader, body):  # the host's time in body(), and the time a step takes, over one pass of the loader
    host, start = 0.0, time.perf_counter()
    for batch in loader:
        t0 = time.perf_counter()
        body(batch)
        host += time.perf_counter() - t0
    torch.cuda.synchronize()
    print(f"{name}: {host / len(loader) * 1e3:.3f} ms host, {(time.perf_counter() - start) / len(loader) * 1e3:.3f} ms")
    return host


def main(steps):
    if not torch.cuda.is_available():
        print("No CUDA GPU on this machine: a CUDA graph needs one, so nothing was run.")
        return
    loader = DataLoader(Features(steps), batch_size=64, num_workers=2, drop_last=True)
    model = torch.nn.Sequential(torch.nn.Linear(24 * 8, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(batch):
        x = torch.cat([batch[f"f{k}"] for k in range(24)], dim=1)
        torch.nn.functional.cross_entropy(model(x), batch["y"]).backward()
        optimizer.step()

    feed = todevice.static(next(iter(loader)), "cuda")  # the buffers the graph reads: views of one device buffer
    side = torch.cuda.Stream()  # warm up on a side stream, then capture, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            optimizer.zero_grad(set_to_none=True)
            step(feed.static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    optimizer.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        step(feed.static)

    def by_handle(batch):
        feed(batch)  # the batch checked, one staging write, one copy, on the stream the replay runs on
        graph.replay()

    def by_copies(batch):
        for k, t in feed.static.items():
            t.copy_(batch[k], non_blocking=True)
        graph.replay()

    def eager(batch):
        optimizer.zero_grad(set_to_none=True)
        step(todevice.move(batch, "cuda"))

    timed("warm-up", loader, by_handle)
    handle = timed("graph fed by todevice.StaticBatch", loader, by_handle)
    copies = timed("graph fed by a copy_() per tensor", loader, by_copies)
    timed("no graph, todevice.move()", loader, eager)
    todevice.check(feed.static, device="cuda")
    print(f"{len(loader)} steps on cuda: the StaticBatch's host time is {copies / handle:.1f}x less")


if __name__ == "__main__":  # DataLoader workers started by spawn or forkserver import this file
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 200)
