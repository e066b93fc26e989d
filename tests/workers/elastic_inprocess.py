"""Elastic torch training that loses ranks and recovers in the same processes (ULFM), for tests/test_elastic_ulfm.py.

A Horovod elastic script (hvd.elastic.run, TorchState, ElasticSampler, a reset callback that rescales the learning
rate), on synthetic data. ``--die ORIG_RANK:WHERE:STEP`` (repeatable) makes the rank that was ORIG_RANK at the start
kill itself with SIGKILL at global step STEP: WHERE is ``backward`` (inside backward, after its other gradients'
allreduces were submitted, so the survivors are inside allreduces), ``commit`` (inside State.commit(), while its
snapshot is taken; ``sync`` with STEP -1: inside the first State.sync() of hvd.elastic.run, in the snapshot rank 0
then broadcasts; ``bcast`` with STEP -1: in this rank's engine as that broadcast starts, so that it fails on some
survivors and ends on others; ``agree`` with STEP -1: in its engine as the survivors' allreduce after a recovery
starts, in which they agree whether each had synced; ``final`` with STEP -1: in its engine as a 2 MB broadcast
from rank 0 after the training loop ends, which then ends on some ranks and fails on others), ``gloo`` (inside a
collective of the torch gloo plane, just after issuing it: run with HOROVOD_CPU_OPERATIONS=gloo), ``idle``
(between steps), ``stop`` (between steps, with SIGSTOP instead: the rank hangs, it does not die), ``reset`` (inside
the reset callback of recovery number STEP, i.e. while the job recovers from an earlier loss) or ``start`` (after
hvd.init, before hvd.elastic.run, in the job hvdlite-run started for its reset STEP); the others only in the first
job hvdlite-run starts. Every rank prints
``start orig=R pid=P`` first and ``final orig=R rank=r size=s pid=P steps=N sha=H`` last (H: a hash of the model's
parameters). ``--dump-resume PREFIX``: after recovery k the new rank 0 writes the state it resumed from (and the
size) to PREFIX.k; ``--load FILE`` starts from such a file instead (the reference run).
"""
import argparse
import atexit
import hashlib
import json
import os
import pickle
import signal
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import hvdlite
import hvdlite.torch as hvd
from report import report


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=480)
    parser.add_argument("--lr", type=float, default=0.05, help="per rank: the optimizer's is lr x hvd.size()")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--weight-decay", type=float, default=0.0)
    parser.add_argument("--lr-half-life", type=float, default=0.0,
                        help="epochs over which the learning rate halves (0: constant), down to --lr-floor")
    parser.add_argument("--lr-floor", type=float, default=0.0, help="per rank, as --lr")
    parser.add_argument("--seed", type=int, default=0, help="the model's initial weights and the samples' order")
    parser.add_argument("--commit-every", type=int, default=4)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--die", action="append", default=[])
    parser.add_argument("--dump-resume", default="")
    parser.add_argument("--load", default="")
    parser.add_argument("--width", type=int, default=32, help="hidden width of the model (benchmarks: larger)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--stop-file", default="",
                        help="(benchmarks/elastic_soak.py) at each epoch's end, once this file exists, the training "
                             "ends (rank 0 looks, every rank follows)")
    parser.add_argument("--soak", action="store_true",
                        help="(benchmarks/elastic_soak.py) rank 0 prints 'step n=N size=S t=T' after every step; "
                             "every sample each epoch processed is counted (an allgather per step), and the final "
                             "report has the per-epoch counts and the training-set accuracy")
    return parser.parse_args()


def dataset(samples, seed=0):
    rng = np.random.RandomState(seed)
    x = rng.randn(samples, 16).astype(np.float32)
    y = (x[:, :4].argmax(1)).astype(np.int64)
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(y))


def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def seconds_alive():
    """Seconds since this process started (/proc: its start time in clock ticks since boot, and the uptime)."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        return float(f.read().split()[0]) - ticks / os.sysconf("SC_CLK_TCK")


def die(where, orig):
    print(f"dying orig={orig} where={where} t={time.time():.6f}", flush=True)
    if os.environ.get("HVDT_DIED_MARKER"):  # a discovery script of the test's lists one slot fewer from now on
        Path(os.environ["HVDT_DIED_MARKER"]).touch()
    os.kill(os.getpid(), signal.SIGKILL)


class Tripwire:
    """Kept in the state so that State.commit() (its snapshot) calls state_dict(): dies there on cue."""

    def __init__(self, orig, plan):
        self.orig, self.plan, self.step = orig, plan, -1

    def state_dict(self):
        for where in ("commit", "sync"):  # (sync: step -1, the snapshot the first State.sync() broadcasts)
            if (where, self.step) in self.plan:
                die(where, self.orig)
        return {}

    def load_state_dict(self, state):
        pass


#: ``--die R:WHERE:-1`` of the engine: the collective of hvd.elastic.run that rank R's engine dies as it starts
ENGINE_DEATHS = {"bcast": ("_broadcast", "hvdlite.elastic.sync.data"),
                 "agree": ("_allreduce", "hvdlite.elastic.synced"), "final": ("_broadcast", "final.data")}


def die_in_the_engine(plan, orig):
    """``bcast``/``agree``: this rank's engine dies as it starts that collective (ENGINE_DEATHS)."""
    from hvdlite.core.engine.execution import Executor
    for where, (method, name) in ENGINE_DEATHS.items():
        def then_die(self, items, where=where, name=name, run=getattr(Executor, method)):
            if items[0].resp.name == name and (where, -1) in plan:
                die(where, orig[0])
            return run(self, items)
        setattr(Executor, method, then_die)  # (before hvd.init: the engine's table takes the methods then)


def main():
    args = parse_args()
    imported = seconds_alive()  # Python and the imports (torch, hvdlite)
    plan, rank = set(), [-1]
    if any(item.split(":")[1] in ENGINE_DEATHS for item in args.die):
        die_in_the_engine(plan, rank)
    hvd.init()
    orig = rank[0] = hvd.rank()
    print(f"start orig={orig} pid={os.getpid()} imported={imported:.2f} initialized={seconds_alive():.2f}",
          flush=True)
    if args.soak:  # (a rank leaving to resize ends its process: when its exit began)
        atexit.register(lambda: print(f"exiting orig={orig} t={time.time():.6f}", flush=True))
    report(orig, start={"pid": os.getpid()})  # by the rank it started as (the test's reports)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    device = torch.device("cpu")
    if args.device == "cuda":
        torch.cuda.set_device(hvd.local_rank() % torch.cuda.device_count())
        device = torch.device("cuda", torch.cuda.current_device())
    restart = int(os.environ.get("HVDLITE_ELASTIC_RESTART", "0"))  # (hvdlite-run's restarts of the job)
    for item in args.die:
        who, where, step = item.split(":")
        if int(who) == orig and (restart == 0 or where == "start"):  # a restarted job does not die again
            plan.add((where, int(step)))
    if ("start", restart) in plan:
        die("start", orig)
    train_set = dataset(args.samples)
    sampler = hvd.elastic.ElasticSampler(train_set, shuffle=True, seed=1 + args.seed)
    loader = DataLoader(train_set, batch_size=args.batch_size, sampler=sampler)
    w = args.width
    seen = np.zeros(len(train_set), dtype=np.int64)  # --soak: how often each sample was processed this epoch
    indices = torch.arange(len(train_set))
    model = nn.Sequential(nn.Linear(16, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 4)).to(device)
    def lr_at(epoch):  # the schedule: a function of the epoch and the size only, so any restart sets it alike
        decay = 0.5 ** (epoch / args.lr_half_life) if args.lr_half_life else 1.0
        return max(args.lr * decay, args.lr_floor) * hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr_at(0), momentum=args.momentum,
                                weight_decay=args.weight_decay)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    tripwire = Tripwire(orig, plan)
    first_weight = model[0].weight

    def backward_hook(grad):
        if ("backward", tripwire.step) in plan:
            die("backward", orig)
        return grad
    first_weight.register_hook(backward_hook)  # the last gradient of backward: the others are in flight
    if any(where == "gloo" for where, _ in plan):
        from hvdlite.torch.plane import TorchPlane
        issued = TorchPlane._run

        def run_then_die(self, work):  # the collective was issued to the peers: die before it completes
            if self.name == "gloo" and ("gloo", tripwire.step) in plan:
                die("gloo", orig)
            issued(self, work)
        TorchPlane._run = run_then_die

    def on_reset():
        if ("reset", len(entries)) in plan:  # inside the recovery from an earlier loss
            die("reset", orig)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(state.epoch)
        print(f"reset orig={orig} rank={hvd.rank()} size={hvd.size()} t={time.time():.6f}", flush=True)

    state = hvd.elastic.TorchState(model, optimizer, train_sampler=sampler, tripwire=tripwire, epoch=0, step=0,
                                   seen=seen, epochs=[])
    state.register_reset_callbacks([on_reset])
    if args.load:
        with open(args.load, "rb") as f:
            snapshot = pickle.load(f)
        state._apply(snapshot["state"])
    entries = []  # hvd.size() at each call of train (after each recovery)
    synced = []  # digest(model) at each call of train

    @hvd.elastic.run
    def train(state):
        entries.append(hvd.size())
        synced.append(digest(model))  # the weights each call starts from (after sync or recovery)
        if len(entries) > 1 and args.dump_resume and hvd.rank() == 0:
            with open(f"{args.dump_resume}.{len(entries) - 1}", "wb") as f:
                pickle.dump({"state": state._snapshot(), "size": hvd.size()}, f)
        steps, started, calls = 0, 0.0, 0
        for epoch in range(state.epoch, args.epochs):
            state.train_sampler.set_epoch(epoch)
            for group in optimizer.param_groups:
                group["lr"] = lr_at(epoch)
            order = list(state.train_sampler)  # this rank's samples of the epoch, in the loader's order
            for batch_idx, (x, y) in enumerate(loader):
                if steps == 1:
                    started = time.time()
                    calls = hvdlite.engine_stats()["mpi_calls"]
                    if hvd.rank() == 0:  # the first step of this entry (job start, restart or recovery) is done
                        print(f"first_step entry={len(entries)} size={hvd.size()} t={started:.6f}", flush=True)
                steps += 1
                tripwire.step = state.step
                state.optimizer.zero_grad()
                F.cross_entropy(state.model(x.to(device)), y.to(device)).backward()
                state.optimizer.step()
                if args.soak:
                    mine = indices[order[batch_idx * args.batch_size:(batch_idx + 1) * args.batch_size]]
                    np.add.at(state.seen, hvd.allgather(mine, name="soak.index").numpy(), 1)
                state.train_sampler.record_batch(batch_idx, args.batch_size)
                state.step += 1
                if args.soak and hvd.rank() == 0:
                    print(f"step n={state.step} size={hvd.size()} t={time.time():.6f}", flush=True)
                if ("idle", state.step) in plan:
                    die("idle", orig)
                if ("stop", state.step) in plan:
                    print(f"stopping orig={orig} t={time.time():.6f}", flush=True)
                    os.kill(os.getpid(), signal.SIGSTOP)
                if args.sleep:
                    time.sleep(args.sleep)
                if state.step % args.commit_every == 0:
                    tripwire.step = state.step
                    state.commit()
            if args.soak:
                state.epochs.append({"samples": int(state.seen.sum()), "unique": int((state.seen > 0).sum())})
                state.seen[:] = 0
            state.epoch = epoch + 1
            state.train_sampler.set_epoch(epoch + 1)
            if args.stop_file and hvd.broadcast_object(os.path.exists(args.stop_file), 0, name="soak.stop"):
                state.commit()
                break
            state.commit()
        if any(item.split(":")[1] == "final" for item in args.die):  # a last collective that ends on some ranks
            hvd.broadcast_object(np.zeros(1 << 18), 0, name="final")  # and fails on others when a rank dies in it
        print(f"trained orig={orig} entry={len(entries)} t={time.time():.6f}", flush=True)
        if hvd.rank() == 0 and steps > 1:
            print(f"steady entry={len(entries)} steps={steps - 1} seconds={time.time() - started:.6f} "
                  f"mpi_calls={hvdlite.engine_stats()['mpi_calls'] - calls}", flush=True)

    train(state)
    final = {"rank": hvd.rank(), "size": hvd.size(), "pid": os.getpid(), "steps": state.step, "entries": entries,
             "synced": synced, "sha": digest(model)}
    if args.soak:
        with torch.no_grad():  # on the training set, and on 4096 samples of the same kind it never saw
            for key, (x, y) in (("accuracy", train_set.tensors), ("test_accuracy", dataset(4096, 1).tensors)):
                final[key] = float((model(x.to(device)).argmax(1).cpu() == y).float().mean())
        final["epochs"] = state.epochs
        print(json.dumps({"final": final}), flush=True)
    print(f"final orig={orig} " + " ".join(f"{k}={v}" for k, v in final.items()), flush=True)
    report(orig, start={"pid": os.getpid()}, final=final)
    hvd.shutdown()


if __name__ == "__main__":
    main()
