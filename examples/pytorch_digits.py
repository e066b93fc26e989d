"""Data-parallel training of a small CNN on scikit-learn's bundled digits with hvdlite.torch.

Launch (any number of processes, 1 included):

    mpiexec -n 2 python examples/pytorch_digits.py
    mpiexec -n 2 python examples/pytorch_digits.py --epochs 5 --checkpoint-dir /tmp/digits
    mpiexec -n 2 python examples/pytorch_digits.py --epochs 10 --checkpoint-dir /tmp/digits --resume
    mpiexec -n 4 python examples/pytorch_digits.py --use-adasum      # 1, 2, 4, 8... processes

The script is written exactly as for Horovod: change the import to ``horovod.torch`` and it runs
there. Each rank trains on its own shard of the training set (DistributedSampler), the learning
rate is scaled by the number of ranks, gradients are averaged by hvd.DistributedOptimizer, and
only rank 0 logs and writes checkpoints. With --use-adasum the ranks' updates are combined with
Adasum instead (Horovod's delta scheme) and, as Horovod advises, the learning rate is not scaled.
The last line on rank 0 is ``test_accuracy=<float>``.
"""
import argparse
import os
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
    parser = argparse.ArgumentParser(description="hvdlite.torch digits example")
    parser.add_argument("--epochs", type=int, default=10, help="epochs to train in total")
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.025, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--fp16-allreduce", action="store_true", help="compress gradients to fp16")
    parser.add_argument("--use-adasum", action="store_true",
                        help="combine updates with Adasum (power-of-two process counts) instead of averaging")
    parser.add_argument("--checkpoint-dir", default=None, help="rank 0 writes checkpoint-<epoch>.pt here")
    parser.add_argument("--checkpoint", default=None, help="resume from this checkpoint file")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint in "
                                                              "--checkpoint-dir, if there is one")
    parser.add_argument("--no-cuda", action="store_true", help="train on CPU even if a GPU is present")
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
        x = F.relu(self.fc1(x.flatten(1)))
        return self.fc2(x)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(list(range(len(labels))), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def checkpoint_path(directory, epoch):
    return os.path.join(directory, f"checkpoint-{epoch}.pt")


def newest_checkpoint(directory):
    if not directory or not os.path.isdir(directory):
        return None
    epochs = [int(name[len("checkpoint-"):-len(".pt")]) for name in os.listdir(directory)
              if name.startswith("checkpoint-") and name.endswith(".pt")]
    return checkpoint_path(directory, max(epochs)) if epochs else None


def evaluate(model, test_set, device):
    """Exact accuracy on the whole test set: each rank scores every size-th example, counts are summed."""
    model.eval()
    shard = Subset(test_set, range(hvd.rank(), len(test_set), hvd.size()))
    correct = total = 0
    with torch.no_grad():
        for images, labels in DataLoader(shard, batch_size=256):
            images, labels = images.to(device), labels.to(device)
            correct += int((model(images).argmax(1) == labels).sum())
            total += len(labels)
    counts = hvd.allreduce(torch.tensor([correct, total], dtype=torch.float64), op=hvd.Sum, name="test_counts")
    return float(counts[0] / counts[1])


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)  # one core per rank; MPI runs one rank per core
    use_cuda = torch.cuda.is_available() and not args.no_cuda
    if use_cuda:
        torch.cuda.set_device(hvd.local_rank())
    device = torch.device("cuda", hvd.local_rank()) if use_cuda else torch.device("cpu")

    train_set, test_set = datasets(args.seed)
    sampler = DistributedSampler(train_set, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True,
                                 seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)

    model = Net().to(device)
    # Averaging divides the summed gradient by size, so the rate is scaled up to match; Adasum adapts the
    # combined step itself and takes the single-process rate (Horovod's guidance for CPU training).
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Resume: rank 0 reads the checkpoint, then the broadcasts below hand its state to every rank.
    resume_from = args.checkpoint or (newest_checkpoint(args.checkpoint_dir) if args.resume else None)
    start_epoch = 0
    if resume_from and hvd.rank() == 0:
        state = torch.load(resume_from, map_location=device)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"]
        print(f"resumed from {resume_from} at epoch {start_epoch}", flush=True)
    start_epoch = hvd.broadcast_object(start_epoch, root_rank=0, name="start_epoch")

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression, op=hvd.Adasum if args.use_adasum else hvd.Average)

    if args.checkpoint_dir and hvd.rank() == 0:
        os.makedirs(args.checkpoint_dir, exist_ok=True)
    accuracy = evaluate(model, test_set, device) if start_epoch >= args.epochs else 0.0
    began = time.time()
    for epoch in range(start_epoch, args.epochs):
        model.train()
        sampler.set_epoch(epoch)
        loss_sum = torch.zeros((), device=device)
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            optimizer.zero_grad()
            loss = F.cross_entropy(model(images), labels)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach()
        train_loss = hvd.allreduce(loss_sum / len(loader), name="train_loss").item()
        accuracy = evaluate(model, test_set, device)
        if hvd.rank() == 0:
            print(f"epoch={epoch + 1} train_loss={train_loss:.4f} test_accuracy={accuracy:.4f} "
                  f"elapsed={time.time() - began:.1f}s", flush=True)
            if args.checkpoint_dir:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1},
                           checkpoint_path(args.checkpoint_dir, epoch + 1))
    if hvd.rank() == 0:
        print(f"test_accuracy={accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
