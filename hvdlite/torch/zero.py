"""ZeroRedundancyOptimizer: ZeRO stage 1, each rank keeps and steps the optimizer state of 1/N of the model."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

import hvdlite.core as core
from hvdlite.core import ProcessSet, global_process_set
from hvdlite.core.frontend import accumulation_of, setting

from .async_ops import Sum, allreduce_async_, grouped_allgather_async, synchronize
from .bucket_sync import BucketSync, ShardReducescatter
from .buckets import Bucket
from .compression import Compression
from .grad_ready import ZERO_GRAD_RACE_ZERO, Readiness, ReadinessOwner, check_passes

#: Optimizers whose per-element rows cannot stand for whole parameters (their updates couple elements).
_NOT_ELEMENTWISE = ("LBFGS", "SparseAdam", "Adafactor", "Muon")


class ZeroRedundancyOptimizer(ReadinessOwner, torch.optim.Optimizer):
    """Shard ``optimizer_class``'s state over ``process_set`` in flat ranges (its update must be elementwise;
    docs/torch.md). Parameters with ``requires_grad=False`` at construction are never stepped."""

    def __init__(self, params: Any, optimizer_class: type, process_set: ProcessSet = global_process_set,
                 *, compression: Any = Compression.none, backward_passes_per_step: int = 1,
                 **defaults: Any) -> None:
        core.size()  # raises NotInitializedError (saying to call hvd.init()) before init
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            raise TypeError(f"ZeroRedundancyOptimizer: optimizer_class must be a torch.optim.Optimizer "
                            f"subclass (e.g. torch.optim.AdamW), got {optimizer_class!r}")
        if optimizer_class.__name__ in _NOT_ELEMENTWISE:
            raise ValueError(f"ZeroRedundancyOptimizer cannot shard {optimizer_class.__name__}: its update "
                             f"couples the elements of a parameter, and shards are flat ranges; use "
                             f"DistributedOptimizer for it")
        check_passes(backward_passes_per_step)
        if accumulation_of(compression) is not None:
            raise ValueError(f"ZeroRedundancyOptimizer: compression={getattr(compression, '__name__', compression)} "
                             f"sums in float32 for allreduce only; ZeRO reduce-scatters its gradients. Use "
                             f"Compression.bf16 or Compression.none here, or DistributedOptimizer for float32 "
                             f"accumulation")
        self._ready = False
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self.process_set = process_set
        member = process_set.included()
        self._n = process_set.size() if member else 1
        self._rank = process_set.rank() if member else 0
        #: the flat buckets (planned here, one row per rank) and their averaging reducescatters
        self._buckets = BucketSync(ShardReducescatter(process_set, compression), process_set, "zero",
                                   setting("fusion_threshold_bytes"), agreed=True)
        self._uid = self._buckets.uid
        self._consolidated: Optional[dict] = None
        self._readiness = Readiness(process_set, backward_passes_per_step, self._on_grad_ready,
                                    [p for g in self.param_groups for p in g["params"]])
        self._enabled = self._readiness.enabled
        for gi, group in enumerate(self.param_groups):
            self._add_buckets(gi, group["params"])
        self.optim = optimizer_class(self._local_groups(), **defaults)
        self._sync_groups(self.optim.param_groups, self.param_groups)
        self._ready = True

    # -- layout -------------------------------------------------------------------------------------
    def _add_buckets(self, gi: int, params: list[torch.Tensor]) -> list[Bucket]:
        new = self._buckets.extend(gi, params, self._n)
        for bucket in new:
            with torch.no_grad():
                bucket.adopt(self._rank)
            self._readiness.watch(bucket.params)
        return new

    def _local_groups(self) -> list[dict]:
        return [{**{k: v for k, v in g.items() if k != "params"},
                 "params": [b.shard for b in self._buckets.buckets if b.group == gi]}
                for gi, g in enumerate(self.param_groups)]

    @staticmethod
    def _sync_groups(source: list[dict], target: list[dict]) -> None:
        for src, dst in zip(source, target):
            dst.update({k: v for k, v in src.items() if k != "params"})

    def add_param_group(self, param_group: dict) -> None:
        """Add a group (as torch.optim.Optimizer.add_param_group); its parameters get buckets of their own."""
        super().add_param_group(param_group)
        if not getattr(self, "_ready", False):
            return  # during __init__: the buckets are planned once every group is known
        gi = len(self.param_groups) - 1
        new = self._add_buckets(gi, self.param_groups[gi]["params"])
        group = {k: v for k, v in self.param_groups[gi].items() if k != "params"}
        self.optim.add_param_group({**group, "params": [b.shard for b in new]})
        self._sync_groups(self.optim.param_groups[-1:], self.param_groups[-1:])

    # -- during backward ----------------------------------------------------------------------------
    def _on_grad_ready(self, p: torch.Tensor, complete: bool) -> None:
        """A backward pass made ``p``'s gradient: it moves into its bucket (freeing autograd's; later passes
        accumulate in place), which starts its reducescatter when complete (overlapping)."""
        self._buckets.take(p, complete, self.overlap)

    def _reduce(self) -> None:
        """Give every shard its averaged gradient (starting the reductions backward has not started)."""
        if not self._enabled:
            for bucket in self._buckets.buckets:
                bucket.collect()
                bucket.shard.grad = bucket.grads  # one row: the whole bucket
            self._buckets.reset()
        else:
            self._buckets.submit_waiting(self.overlap)
            self._buckets.finish()
        self._readiness.reset()

    # -- public API ---------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Average the gradients into the shards, step this rank's shard, share the new parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for bucket in self._buckets.buckets:  # a parameter whose .data was replaced goes back into its bucket
            bucket.adopt(self._rank)
        present = self._presence()
        self._reduce()
        held = self._hold(present())
        self._sync_groups(self.param_groups, self.optim.param_groups)
        self.optim.step()  # updates this rank's rows of the parameters in place
        self._sync_groups(self.optim.param_groups, self.param_groups)
        for bucket, a, b, saved, states in held:  # parameters no rank had a gradient for: as if not stepped
            bucket.shard[a:b].copy_(saved)
            for i, (_, value) in enumerate(self._per_element(bucket)):
                value[a:b].copy_(states[i]) if states is not None else value[a:b].zero_()
        buckets = self._buckets.buckets
        if self._enabled and buckets:  # every rank's updated rows, into the parameters' buffers
            synchronize(grouped_allgather_async([b.shard.view(1, b.row) for b in buckets],
                                                name=f"{self._uid}.params", process_set=self.process_set,
                                                outputs=[b.values.view(b.rows, b.row) for b in buckets]))
        for bucket in buckets:
            bucket.shard.grad = None
        return loss

    def _presence(self) -> Callable[[], Optional[torch.Tensor]]:
        """Start counting, over the set, the ranks that have a gradient for each parameter (one small
        allreduce, waited for, by calling the result, after the gradients' own reductions)."""
        flags = torch.tensor([int(p.grad is not None) for b in self._buckets.buckets for p in b.params],
                             dtype=torch.int32)
        if not self._enabled or flags.numel() == 0:
            return lambda: flags if not self._enabled else None
        return allreduce_async_(flags, name=f"{self._uid}.present", op=Sum, process_set=self.process_set).wait

    def _per_element(self, bucket: Bucket) -> list[tuple[str, torch.Tensor]]:
        """The local optimizer's state entries for ``bucket`` that hold one value per shard element, by key."""
        state = self.optim.state.get(bucket.shard, {})
        return [(k, v) for k, v in sorted(state.items()) if is_elementwise(v, bucket.shard)]

    def _hold(self, present: Optional[torch.Tensor]) -> list[tuple[Bucket, int, int, torch.Tensor, Any]]:
        """This rank's elements of parameters no rank has a gradient for, with their per-element optimizer
        state, saved before the local step (torch's optimizers leave such a parameter alone; weight decay
        and momentum would move it here). A scalar state such as Adam's step count is per bucket row."""
        held: list[tuple[Bucket, int, int, torch.Tensor, Any]] = []
        if present is None or bool(present.all()):
            return held
        flags = iter(present.tolist())
        for bucket in self._buckets.buckets:
            lo, hi = bucket.span(self._rank)
            fresh = not self.optim.state.get(bucket.shard)  # its state is created by this step: from zeros
            for off, n in zip(bucket.offsets, bucket.numels):
                a, b = max(lo, off) - lo, min(hi, off + n) - lo
                if next(flags) or a >= b:
                    continue
                states = None if fresh else [v[a:b].clone() for _, v in self._per_element(bucket)]
                held.append((bucket, a, b, bucket.shard[a:b].clone(), states))
        return held

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._readiness.check_zero_grad(ZERO_GRAD_RACE_ZERO)
        super().zero_grad(set_to_none)  # gradients are views of the buckets: set_to_none releases those too
        for bucket in self._buckets.buckets:
            bucket.shard.grad = None
            if set_to_none:
                bucket.grads = None

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Collective over the set: gather every shard's state into a whole, ordinary optimizer state dict
        on global rank ``to`` (read it there with state_dict())."""
        entries = [(k, key, value) for k, bucket in enumerate(self._buckets.buckets)  # every per-element state row
                   for key, value in self._per_element(bucket)]
        if self._enabled and entries:
            wholes = synchronize(grouped_allgather_async([v.reshape(1, -1) for _, _, v in entries],
                                                         name=f"{self._uid}.consolidate",
                                                         process_set=self.process_set))
        else:
            wholes = [v for _, _, v in entries]
        self._consolidated = None
        if core.rank() != to:
            return
        index = {id(p): i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        per_param: dict[int, dict[str, Any]] = {}
        for (k, key, _), whole in zip(entries, wholes):
            for p, value in zip(self._buckets.buckets[k].params, self._buckets.buckets[k].split(whole)):
                per_param.setdefault(index[id(p)], {})[key] = value.clone()
        for bucket in self._buckets.buckets:
            local = self.optim.state.get(bucket.shard, {})
            for key, value in local.items():
                if not is_elementwise(value, bucket.shard):
                    for p in bucket.params:
                        copied = value.clone() if isinstance(value, torch.Tensor) else value
                        per_param.setdefault(index[id(p)], {})[key] = copied
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        self._consolidated = {"state": dict(sorted(per_param.items())), "param_groups": groups}

    def state_dict(self) -> dict:
        """The dict gathered by the last consolidate_state_dict(to=this rank)."""
        if self._consolidated is None:
            raise RuntimeError(f"rank {core.rank()}: ZeroRedundancyOptimizer.state_dict() has no consolidated "
                               f"state on this rank; call optimizer.consolidate_state_dict(to={core.rank()}) on "
                               f"every rank of the set first, then state_dict() on rank {core.rank()}")
        return self._consolidated

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a consolidated dict (from state_dict(), at any set size) on every rank; each keeps its shard."""
        saved = state_dict["param_groups"]
        sizes = [len(g["params"]) for g in self.param_groups]
        if [len(g["params"]) for g in saved] != sizes:
            raise ValueError(f"rank {core.rank()}: load_state_dict: the state dict has groups of "
                             f"{[len(g['params']) for g in saved]} parameters, this optimizer {sizes}; load a "
                             f"dict saved for the same model and param groups")
        self._buckets.finish(use=False)  # never leave a collective unwaited
        self._readiness.reset()
        for group, saved_group in zip(self.param_groups, saved):
            group.update({k: v for k, v in saved_group.items() if k != "params"})
        ids = {id(p): saved_idx for g, sg in zip(self.param_groups, saved)
               for p, saved_idx in zip(g["params"], sg["params"])}
        states = state_dict["state"]
        local_groups = self._local_groups()
        local_index = {id(s): i for i, s in enumerate(s for g in local_groups for s in g["params"])}
        local_state = {}
        for bucket in self._buckets.buckets:
            found = [states.get(ids[id(p)], states.get(str(ids[id(p)]))) for p in bucket.params]
            shard = shard_state(bucket, found, self._rank)
            if shard:
                local_state[local_index[id(bucket.shard)]] = shard
        self.optim.load_state_dict({"state": local_state,
                                    "param_groups": [{**g, "params": [local_index[id(s)] for s in g["params"]]}
                                                     for g in local_groups]})
        self._sync_groups(self.optim.param_groups, self.param_groups)

    def __repr__(self) -> str:
        return (f"ZeroRedundancyOptimizer({self.optimizer_class.__name__}, rank {self._rank} of {self._n}, "
                f"{len(self._buckets.buckets)} buckets)")


def is_elementwise(value: Any, shard: torch.Tensor) -> bool:
    """Whether a local optimizer's state entry holds one value per shard element (else it is a scalar)."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shard.numel()


def shard_state(bucket: Bucket, states: list[Optional[dict]], rank: int) -> dict[str, Any]:
    """This rank's local optimizer state for ``bucket`` from the per-parameter states of a consolidated dict."""
    present = [s is not None and len(s) > 0 for s in states]
    if not any(present):
        return {}
    if not all(present):
        missing = [i for i, ok in enumerate(present) if not ok]
        raise ValueError(f"load_state_dict: the state dict has optimizer state for some parameters of bucket "
                         f"{bucket.name} but not for parameters at bucket positions {missing}; the sharded "
                         f"optimizer steps a bucket as one, so load a dict written by consolidate_state_dict()")
    full = [s for s in states if s]
    out: dict[str, Any] = {}
    for key in full[0]:
        values = [s[key] for s in full]
        per_element = all(isinstance(v, torch.Tensor) and v.shape == p.shape and (v.dim() > 0 or key != "step")
                          for v, p in zip(values, bucket.params))
        if per_element:
            out[key] = bucket.own(values, rank, values[0].dtype)
            continue
        first = values[0]
        same = all((torch.equal(v, first) if isinstance(v, torch.Tensor) and isinstance(first, torch.Tensor)
                    else v == first) for v in values[1:])
        if not same:
            raise ValueError(f"load_state_dict: state {key!r} differs between parameters of bucket {bucket.name} "
                             f"but is neither per-element nor shared; the sharded optimizer cannot hold it")
        out[key] = first.clone() if isinstance(first, torch.Tensor) else first
    return out
