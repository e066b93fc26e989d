"""Elastic data-parallel training of a small CNN on scikit-learn's digits with hvdlite.torch.elastic.

Launch (hvdlite-run is the elastic driver; the job survives lost ranks and grows when hosts come back):

    hvdlite-run -np 3 --min-np 2 --max-np 3 --host-discovery-script ./discover_hosts.sh \\
        python examples/pytorch_digits_elastic.py
    hvdlite-run -np 3 --min-np 2 --max-np 3 python examples/pytorch_digits_elastic.py   # this machine
    mpiexec -n 2 python examples/pytorch_digits_elastic.py                               # not elastic

where discover_hosts.sh prints the usable hosts, one ``host:slots`` a line. The script is written as
for Horovod (change the import to ``horovod.torch`` and it runs there): the model, optimizer, sampler
and counters live in a TorchState, committed every --batches-per-commit batches; after a restart the
training resumes from the last commit, mid-epoch, and the reset callback rescales the learning rate to
the new number of ranks. Rank 0 prints ``commit=...`` at every commit, one ``epoch=...`` line per epoch
with how many training samples the epoch processed (``samples``, ``unique``: equal to ``of`` when
nothing was repeated or skipped), and last ``test_accuracy=<float>``.
"""
import argparse
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

import hvdlite.torch as hvd


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite.torch elastic digits example")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=12, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.02, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--batches-per-commit", type=int, default=5)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--sleep", type=float, default=0.0, help="seconds to wait after each batch (tests)")
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
    """1440 training images (divisible by 2 and 3 ranks times the batch) and 357 test images; the
    training set also yields each sample's index, to count what every epoch processed."""
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(list(range(len(labels))), test_size=357, random_state=seed,
                                           stratify=digits.target)
    train = TensorDataset(images[train_idx], labels[train_idx], torch.arange(len(train_idx)))
    return train, TensorDataset(images[test_idx], labels[test_idx])


def evaluate(model, test_set):
    """Exact accuracy on the whole test set: each rank scores every size-th example, counts are summed."""
    model.eval()
    images, labels = test_set.tensors
    mine = slice(hvd.rank(), len(labels), hvd.size())
    with torch.no_grad():
        correct = int((model(images[mine]).argmax(1) == labels[mine]).sum())
    counts = hvd.allreduce(torch.tensor([correct, len(labels[mine])], dtype=torch.float64), op=hvd.Sum,
                           name="test_counts")
    return float(counts[0] / counts[1])


def train_batch(state, batch_idx, images, labels, index, args):
    """One step of SGD over every rank's batch; counts the samples the ranks processed and records the batch in
    the sampler, so that a restart goes on after it."""
    state.optimizer.zero_grad()
    F.cross_entropy(state.model(images), labels).backward()
    state.optimizer.step()
    everyone = hvd.allgather(index, name="sample_index").numpy()
    np.add.at(state.seen, everyone, 1)
    state.train_sampler.record_batch(batch_idx, args.batch_size)
    state.batch += 1
    if args.sleep:
        time.sleep(args.sleep)


def main():
    args = parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = datasets(args.seed)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def on_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        if hvd.rank() == 0:
            print(f"reset: size={hvd.size()} lr={args.lr * hvd.size():.4f}", flush=True)

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0,
                                   seen=np.zeros(len(train_set), dtype=np.int64))
    state.register_reset_callbacks([on_reset])

    @hvd.elastic.run
    def train(state):
        for epoch in range(state.epoch, args.epochs):
            state.model.train()
            state.train_sampler.set_epoch(epoch)  # the epoch in progress keeps what it has processed
            for batch_idx, (images, labels, index) in enumerate(loader):
                train_batch(state, batch_idx, images, labels, index, args)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                    if hvd.rank() == 0:
                        print(f"commit={state.commit_counter} epoch={epoch} batch={state.batch} "
                              f"size={hvd.size()}", flush=True)
            accuracy = evaluate(state.model, test_set)
            if hvd.rank() == 0:
                print(f"epoch={epoch + 1} samples={int(state.seen.sum())} unique={int((state.seen > 0).sum())} "
                      f"of={len(train_set)} size={hvd.size()} test_accuracy={accuracy:.4f}", flush=True)
            state.epoch, state.seen[:] = epoch + 1, 0
            state.train_sampler.set_epoch(epoch + 1)
            state.commit()
        return evaluate(state.model, test_set)

    accuracy = train(state)
    if hvd.rank() == 0:
        print(f"test_accuracy={accuracy:.4f}", flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
