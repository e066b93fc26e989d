"""Lightning 2.x training of a small CNN on scikit-learn's digits over hvdlite (HvdliteStrategy).

Launch (any number of processes, 1 included; Lightning starts no processes of its own):

    mpiexec -n 2 python examples/lightning_digits.py
    hvdlite-run -np 2 python examples/lightning_digits.py --epochs 5 --checkpoint-dir /tmp/ldigits
    hvdlite-run -np 2 python examples/lightning_digits.py --epochs 8 --checkpoint-dir /tmp/ldigits --resume
    srun -n 2 --mpi=pmi2 python examples/lightning_digits.py

Lightning injects a DistributedSampler (each rank trains on its shard), hvdlite averages the gradients
(allreduces started from backward), rank 0's initial weights are broadcast, checkpoints are written by
rank 0 only, and metrics logged with sync_dist=True are averaged over the ranks. The learning rate is
scaled by the number of ranks here (the global batch grows with it); the strategy itself never changes it.
The last line on rank 0 is ``test_accuracy=<float>``.
"""
import argparse
import glob
import os

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch.utils.data import DataLoader, TensorDataset

from hvdlite.lightning import HvdliteStrategy  # importing hvdlite.lightning also registers strategy="hvdlite"


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite Lightning digits example")
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=32, help="batch size per rank")
    parser.add_argument("--lr", type=float, default=0.025, help="learning rate for one rank (scaled by size)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--checkpoint-dir", default=None, help="rank 0 writes a checkpoint per epoch here")
    parser.add_argument("--resume", action="store_true", help="resume from the newest checkpoint there")
    return parser.parse_args()


class DigitsCNN(L.LightningModule):
    def __init__(self, lr):
        super().__init__()
        self.save_hyperparameters()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))

    def training_step(self, batch, batch_idx):
        images, labels = batch
        loss = F.cross_entropy(self(images), labels)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def test_step(self, batch, batch_idx):
        images, labels = batch
        accuracy = (self(images).argmax(1) == labels).float().mean()
        self.log("test_accuracy", accuracy, sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(1)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.hparams.lr * self.trainer.world_size, momentum=0.9)


def datasets(seed):
    digits = load_digits()
    images = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    labels = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(list(range(len(labels))), test_size=0.2, random_state=seed,
                                           stratify=digits.target)
    return TensorDataset(images[train_idx], labels[train_idx]), TensorDataset(images[test_idx], labels[test_idx])


def main():
    args = parse_args()
    L.seed_everything(args.seed, verbose=False)
    torch.set_num_threads(1)  # one core per rank
    train_set, test_set = datasets(args.seed)
    strategy = HvdliteStrategy()
    callbacks = []
    if args.checkpoint_dir:
        callbacks.append(L.pytorch.callbacks.ModelCheckpoint(dirpath=args.checkpoint_dir, save_top_k=-1))
    trainer = L.Trainer(strategy=strategy, max_epochs=args.epochs, callbacks=callbacks, logger=False,
                        enable_checkpointing=bool(args.checkpoint_dir), enable_progress_bar=False,
                        enable_model_summary=False)
    resume = None
    if args.resume and args.checkpoint_dir:
        found = sorted(glob.glob(os.path.join(args.checkpoint_dir, "*.ckpt")), key=os.path.getmtime)
        resume = strategy.broadcast(found[-1] if found else None)  # every rank resumes from rank 0's choice
    model = DigitsCNN(args.lr)
    trainer.fit(model, DataLoader(train_set, batch_size=args.batch_size, shuffle=True), ckpt_path=resume)
    if trainer.is_global_zero:
        print(f"epochs={trainer.current_epoch} train_loss={float(trainer.callback_metrics['train_loss']):.4f}",
              flush=True)
    # Each rank scores its shard; the logged accuracy is averaged over the ranks (equal shards: exact)
    tested = trainer.test(model, DataLoader(test_set, batch_size=64), verbose=False)
    predictions = trainer.predict(model, DataLoader(test_set, batch_size=64))
    predicted = int(strategy.reduce(torch.tensor(sum(len(p) for p in predictions)), reduce_op="sum"))
    if trainer.is_global_zero:
        print(f"predicted={predicted} of {len(test_set)}", flush=True)
        print(f"test_accuracy={tested[0]['test_accuracy']:.4f}", flush=True)


if __name__ == "__main__":
    main()
