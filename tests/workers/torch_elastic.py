"""examples/pytorch_digits_elastic.py's training (its arguments, model, data, step and evaluation, imported from
it) with results in JSON instead of printed lines, for tests/test_elastic.py and tests/test_elastic_hosts.py.

Every rank reports (tests/workers/report.py) ``progress`` at each commit (``commit``, ``epoch``: the one in
progress, from 0, ``batch``: batches since the start, ``size``) and, at the end, ``final``: the size, the test
accuracy, a hash of the weights, and, kept in the elastic state (so as committed, across restarts), ``epochs``:
one record per finished epoch (how many training samples it processed, how many of them distinct, of how many;
the size and learning rate it ran at; the accuracy after it) and ``resets``: the size and learning rate each run
of the reset callback set."""
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

import hvdlite.torch as hvd
from elastic_inprocess import digest
from report import report

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
import pytorch_digits_elastic as example  # noqa: E402 - the example's directory is on the path from here on


def main():
    args = example.parse_args()
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    train_set, test_set = example.datasets(args.seed)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    model = example.Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    def lr():
        return optimizer.param_groups[0]["lr"]

    def on_reset():
        for group in optimizer.param_groups:
            group["lr"] = args.lr * hvd.size()
        state.resets.append({"size": hvd.size(), "lr": lr()})

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, epoch=0, batch=0,
                                   seen=np.zeros(len(train_set), dtype=np.int64), epochs=[], resets=[])
    state.register_reset_callbacks([on_reset])

    def progress(epoch):
        return {"commit": state.commit_counter, "epoch": epoch, "batch": state.batch, "size": hvd.size()}

    @hvd.elastic.run
    def train(state):
        for epoch in range(state.epoch, args.epochs):
            state.model.train()
            state.train_sampler.set_epoch(epoch)
            for batch_idx, (images, labels, index) in enumerate(loader):
                example.train_batch(state, batch_idx, images, labels, index, args)
                if state.batch % args.batches_per_commit == 0:
                    state.commit()
                    report(hvd.rank(), progress=progress(epoch))
            accuracy = example.evaluate(state.model, test_set)
            state.epochs.append({"epoch": epoch + 1, "samples": int(state.seen.sum()),
                                 "unique": int((state.seen > 0).sum()), "of": len(train_set), "size": hvd.size(),
                                 "lr": lr(), "accuracy": accuracy})
            state.epoch, state.seen[:] = epoch + 1, 0
            state.train_sampler.set_epoch(epoch + 1)
            state.commit()
        return example.evaluate(state.model, test_set)

    accuracy = train(state)
    report(hvd.rank(), progress=progress(state.epoch),
           final={"size": hvd.size(), "accuracy": accuracy, "sha": digest(model), "epochs": state.epochs,
                  "resets": state.resets})
    hvd.shutdown()


if __name__ == "__main__":
    main()
