"""Data-parallel training on scikit-learn's digits with a sharded optimizer: hvd.ZeroRedundancyOptimizer.

Launch (any number of processes, 1 included):

    mpiexec -n 2 python examples/pytorch_digits_zero.py
    mpiexec -n 2 python examples/pytorch_digits_zero.py --checkpoint /tmp/digits_zero.pt
    mpiexec -n 3 python examples/pytorch_digits_zero.py --epochs 12 --resume /tmp/digits_zero.pt

Compared with examples/pytorch_digits.py, one line changes: instead of wrapping an optimizer in
hvd.DistributedOptimizer, the script builds hvd.ZeroRedundancyOptimizer(params, torch.optim.AdamW, ...).
Each rank then keeps AdamW's two moments for only 1/N of the parameters (ZeRO stage 1). Checkpoints are
consolidated on rank 0 (a collective) and can be loaded at any job size: every rank loads the same file and
keeps its own shard. The last line on rank 0 is ``test_accuracy=<float>``.
"""
import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, Subset, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import hvdlite.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite.torch digits example with ZeroRedundancyOptimizer")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train in total")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.002, help="AdamW learning rate for one rank (x size)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--bf16-reduce", action="store_true", help="send gradients as bfloat16")
    parser.add_argument("--checkpoint", default=None, help="write model + consolidated optimizer state here")
    parser.add_argument("--resume", default=None, help="resume from this checkpoint (saved at any size)")
    return parser.parse_args()


class Net(nn.Module):
    """Two 3x3 convolutions and a small classifier, for 1x8x8 images."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(list(range(len(labels))), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def evaluate(model, test_set):
    """Exact accuracy on the whole test set: each rank scores every size-th example, counts are summed."""
    model.eval()
    shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    correct = total = 0
    with torch.no_grad():
        for images, labels in DataLoader(shard, batch_size=256):
            correct += int((model(images).argmax(1) == labels).sum())
            total += len(labels)
    counts = hvd.allreduce(torch.tensor([correct, total], dtype=torch.float64), op=hvd.Sum, name="test_counts")
    return float(counts[0] / counts[1])


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per rank; MPI runs one rank per core

    train_set, test_set = datasets(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = Net()
    compression = hvd.Compression.bf16 if args.bf16_reduce else hvd.Compression.none
    optimizer = hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=args.lr * hvd.size(),
                                            weight_decay=0.01, compression=compression)

    start_epoch = 0
    if args.resume:  # every rank reads the whole checkpoint; the optimizer keeps only this rank's shard
        state = torch.load(args.resume, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        if hvd.rank() == 0:
            print(f"resumed from {args.resume} at epoch {start_epoch}", flush=True)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # same start everywhere

    accuracy = evaluate(model, test_set)
    began = time.time()
    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros(())
        for images, labels in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()  # averages gradients, steps this rank's shard, shares the new parameters
            loss_sum += loss.detach()
        train_loss = hvd.allreduce(loss_sum / len(loader), name="train_loss").item()
        accuracy = evaluate(model, test_set)
        if hvd.rank() == 0:
            print(f"epoch={epoch + 1} train_loss={train_loss:.4f} test_accuracy={accuracy:.4f} "
                  f"elapsed={time.time() - began:.1f}s", flush=True)

    if args.checkpoint:
        optimizer.consolidate_state_dict(to=0)  # every rank takes part
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": args.epochs},
                       args.checkpoint)
    if hvd.rank() == 0:
        print(f"test_accuracy={accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
