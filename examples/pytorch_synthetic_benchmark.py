"""Synthetic-data training throughput of a ResNet with hvdlite.torch (Horovod's benchmark, plain torch).

Launch (any number of processes, 1 included):

    mpiexec -n 2 python examples/pytorch_synthetic_benchmark.py
    mpiexec -n 2 python examples/pytorch_synthetic_benchmark.py --model resnet50 --batch-size 32 \\
        --image-size 224 --num-warmup-batches 10 --num-batches-per-iter 10 --num-iters 10 --fp16-allreduce

Takes Horovod's flags (--model, --batch-size, --num-warmup-batches, --num-batches-per-iter,
--num-iters, --fp16-allreduce, --use-adasum, --no-cuda) plus --image-size, --num-classes and
--hvd-module (the Horovod-compatible module to train with, default hvdlite.torch; ``--hvd-module
horovod.torch`` runs the same program on Horovod, for benchmarks/synthetic_vs_horovod.py). The
defaults are small so that it finishes in seconds on CPU. Rank 0 prints images/sec per process and
in total, and a parseable last line ``total_samples_per_sec=<float>``.
"""
import argparse
import importlib
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A ResNet basic block (two 3x3 convolutions) or bottleneck block (1x1, 3x3, 1x1)."""

    def __init__(self, inplanes, planes, stride, bottleneck):
        super().__init__()
        expansion = 4 if bottleneck else 1
        width = planes
        if bottleneck:
            shapes = [(inplanes, width, 1, 1), (width, width, 3, stride), (width, planes * expansion, 1, 1)]
        else:
            shapes = [(inplanes, planes, 3, stride), (planes, planes, 3, 1)]
        self.convs = nn.ModuleList(nn.Conv2d(i, o, k, s, padding=k // 2, bias=False) for i, o, k, s in shapes)
        self.bns = nn.ModuleList(nn.BatchNorm2d(o) for _, o, _, _ in shapes)
        self.shortcut = None
        if stride != 1 or inplanes != planes * expansion:
            self.shortcut = nn.Sequential(nn.Conv2d(inplanes, planes * expansion, 1, stride, bias=False),
                                          nn.BatchNorm2d(planes * expansion))

    def forward(self, x):
        out = x
        for i, (conv, bn) in enumerate(zip(self.convs, self.bns)):
            out = bn(conv(out))
            if i < len(self.convs) - 1:
                out = F.relu(out)
        return F.relu(out + (x if self.shortcut is None else self.shortcut(x)))


class ResNet(nn.Module):
    LAYOUTS = {"resnet18": ([2, 2, 2, 2], False), "resnet34": ([3, 4, 6, 3], False),
               "resnet50": ([3, 4, 6, 3], True), "resnet101": ([3, 4, 23, 3], True)}

    def __init__(self, name, num_classes):
        super().__init__()
        blocks, bottleneck = self.LAYOUTS[name]
        self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        layers, inplanes = [], 64
        for stage, count in enumerate(blocks):
            planes = 64 * 2 ** stage
            for i in range(count):
                layers.append(Block(inplanes, planes, 2 if stage and i == 0 else 1, bottleneck))
                inplanes = planes * (4 if bottleneck else 1)
        self.layers = nn.Sequential(*layers)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.layers(self.stem(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def parse_args():
    parser = argparse.ArgumentParser(description="hvdlite.torch synthetic benchmark",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--fp16-allreduce", action="store_true", default=False,
                        help="use fp16 compression during allreduce")
    parser.add_argument("--model", default="resnet18", choices=sorted(ResNet.LAYOUTS), help="model to benchmark")
    parser.add_argument("--batch-size", type=int, default=8, help="input batch size per process")
    parser.add_argument("--image-size", type=int, default=64, help="height and width of the synthetic images")
    parser.add_argument("--num-classes", type=int, default=1000)
    parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches that "
                                                                          "don't count towards benchmark")
    parser.add_argument("--num-batches-per-iter", type=int, default=2, help="number of batches per benchmark "
                                                                            "iteration")
    parser.add_argument("--num-iters", type=int, default=3, help="number of benchmark iterations")
    parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm")
    parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    parser.add_argument("--hvd-module", default="hvdlite.torch",
                        help="the Horovod-compatible module to train with (e.g. horovod.torch)")
    return parser.parse_args()


def main():
    args = parse_args()
    hvd = importlib.import_module(args.hvd_module)
    hvd.init()
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    else:
        torch.set_num_threads(1)  # one core per process
    device = torch.device("cuda" if cuda else "cpu")

    model = ResNet(args.model, args.num_classes).to(device)
    lr_scaler = hvd.size() if not args.use_adasum else 1
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device)
    target = torch.randint(0, args.num_classes, (args.batch_size,), device=device)

    def benchmark_step():
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text):
        if hvd.rank() == 0:
            print(text, flush=True)

    device_name = "GPU" if cuda else "CPU"
    log(f"Model: {args.model}")
    log(f"Batch size: {args.batch_size}")
    log(f"Image size: {args.image_size}")
    log(f"Number of {device_name}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for it in range(args.num_iters):
        elapsed = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / elapsed
        log(f"Iter #{it}: {img_sec:.1f} img/sec per {device_name}")
        img_secs.append(img_sec)
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per {device_name}: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} {device_name}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    log(f"total_samples_per_sec={hvd.size() * mean:.2f}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
