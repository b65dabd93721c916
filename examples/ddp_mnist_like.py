"""A plain PyTorch DDP training script: a small CNN on MNIST-like digits.

Nothing here knows about stalwart: it is the kind of script you would start with

    torchrun --nproc-per-node 4 examples/ddp_mnist_like.py --steps 600

and `stalwart run --script` starts it the same way, on emulated hosts with real faults:

    sudo stalwart run --script examples/ddp_mnist_like.py --testbed netns --nproc 4 --detect \\
        --fault compute:rank=2,factor=2,start=10s -- --steps 600

The data are synthetic (no download): 28x28 grey images of 10 classes, each class a fixed random
stroke pattern, shifted by a pixel or two and covered in noise, so that accuracy climbs from
10% to near 100% within a few hundred steps.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def make_digits(n: int, seed: int) -> TensorDataset:
    """n images of 10 classes: class prototypes (seed 0, the same for every split), shifted
    and noisy (this split's seed)."""
    protos = (torch.rand(10, 1, 28, 28, generator=torch.Generator().manual_seed(0)) > 0.8)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = protos[labels].float()
    shift = torch.randint(0, 25, (n,), generator=g)  # one of 5x5 small translations
    for k in range(25):
        pick = shift == k
        images[pick] = torch.roll(images[pick], shifts=(k // 5 - 2, k % 5 - 2), dims=(2, 3))
    images += 0.6 * torch.randn(images.shape, generator=g)
    return TensorDataset(images, labels)


class SmallCNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=600, help="optimizer steps (default 600)")
    p.add_argument("--batch-size", type=int, default=32, help="per rank (default 32)")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--log-every", type=int, default=50)
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # env:// -- RANK, WORLD_SIZE, MASTER_ADDR/PORT
    rank, world = dist.get_rank(), dist.get_world_size()

    train = make_digits(4096, seed=1)
    test = make_digits(1024, seed=2)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)

    torch.manual_seed(0)
    model = DDP(SmallCNN())
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    step, epoch, t0 = 0, 0, time.perf_counter()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            step += 1
            if rank == 0 and step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f} "
                      f"({(time.perf_counter() - t0) / step * 1000:.0f} ms/step)", flush=True)
            if step >= args.steps:
                break
        epoch += 1

    # accuracy on the held-out split, each rank a share, summed over ranks
    model.eval()
    correct = torch.zeros(1)
    with torch.no_grad():
        xs, ys = test.tensors
        mine = slice(rank, None, world)
        correct += (model(xs[mine]).argmax(1) == ys[mine]).sum()
    dist.all_reduce(correct)
    if rank == 0:
        print(f"done: {step} steps in {time.perf_counter() - t0:.1f}s, test accuracy "
              f"{correct.item() / len(ys):.3f} (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
