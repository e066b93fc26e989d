"""Worker written as a horovod.torch user writes a script; only its import line names the replacement.

It follows the structure of Horovod's PyTorch examples (argparse flags, DistributedSampler, lr scaled by
size, broadcast of parameters and optimizer state, DistributedOptimizer with compression, metric
averaging with named allreduces, gradient clipping, resume-epoch broadcast, join) on synthetic data.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import hvdlite.torch as hvd

parser = argparse.ArgumentParser(description="Horovod-style PyTorch training")
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--epochs", type=int, default=4)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--fp16-allreduce", action="store_true", default=False)
parser.add_argument("--use-adasum", action="store_true", default=False)
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)
parser.add_argument("--clip", type=float, default=5.0)
parser.add_argument("--no-cuda", action="store_true", default=False)


class Net(nn.Module):
    def __init__(self):
        super(Net, self).__init__()
        self.fc1 = nn.Linear(10, 32)
        self.bn = nn.BatchNorm1d(32)
        self.fc2 = nn.Linear(32, 3)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.bn(self.fc1(x)))), dim=1)


def make_dataset(n, seed):
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 3, (n,), generator=g)
    centres = torch.randn(3, 10, generator=torch.Generator().manual_seed(0)) * 3
    return torch.utils.data.TensorDataset(centres[labels] + torch.randn(n, 10, generator=g), labels)


def metric_average(val, name):
    tensor = torch.tensor(val)
    avg_tensor = hvd.allreduce(tensor, name=name)
    return avg_tensor.item()


def train(epoch):
    model.train()
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.synchronize()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
        with optimizer.skip_synchronize():
            optimizer.step()


def test():
    model.eval()
    test_loss = 0.
    test_accuracy = 0.
    for data, target in test_loader:
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        output = model(data)
        test_loss += F.nll_loss(output, target, reduction="sum").item()
        pred = output.data.max(1, keepdim=True)[1]
        test_accuracy += pred.eq(target.data.view_as(pred)).cpu().float().sum()
    test_loss /= len(test_sampler)
    test_accuracy /= len(test_sampler)
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if hvd.rank() == 0:
        print("Test set: Average loss: {:.4f}, Accuracy: {:.2f}%".format(test_loss, 100. * test_accuracy))
    return test_accuracy


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)
    torch.set_num_threads(1)

    train_dataset = make_dataset(480, 1)
    train_sampler = torch.utils.data.distributed.DistributedSampler(
        train_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_dataset = make_dataset(240, 2)
    test_sampler = torch.utils.data.distributed.DistributedSampler(
        test_dataset, num_replicas=hvd.size(), rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=64, sampler=test_sampler)

    torch.manual_seed(args.seed + hvd.rank())  # different initial weights: the broadcast must fix them
    model = Net()
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    resume_from_epoch = hvd.broadcast(torch.tensor(0), root_rank=0, name="resume_from_epoch").item()
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer,
                                         named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)
    scheduler = optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

    accuracy = 0.
    for epoch in range(resume_from_epoch + 1, args.epochs + 1):
        train(epoch)
        scheduler.step()
        accuracy = test()

    weights = torch.cat([p.data.view(-1) for p in model.parameters()])
    gathered = hvd.allgather(weights.unsqueeze(0))
    assert all(torch.equal(row, weights) for row in gathered), "weights differ between ranks"
    assert hvd.allgather_object(round(accuracy, 6)) == [round(accuracy, 6)] * hvd.size()
    assert accuracy > 0.9, "accuracy {} too low".format(accuracy)
    assert optimizer.param_groups[0]["lr"] == args.lr * lr_scaler * 0.25
    hvd.join()
    if hvd.rank() == 0:
        print("MIGRATION_OK accuracy={:.4f} size={}".format(accuracy, hvd.size()))
