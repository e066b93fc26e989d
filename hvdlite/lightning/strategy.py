"""HvdliteStrategy: Lightning 2.x data-parallel training over hvdlite, one process per rank started by the
launcher (mpiexec, hvdlite-run, srun), gradients averaged by hvdlite.torch.DistributedOptimizer; and
HvdliteEnvironment, Lightning's view of the job (rank, size, node) taken from hvdlite."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Generator, Optional, Union

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies.parallel import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor

import hvdlite.torch as hvd

__all__ = ["HvdliteEnvironment", "HvdliteStrategy"]

_log = logging.getLogger(__name__)

#: Lightning's reduce_op names (and torch.distributed.ReduceOp members, by name) -> hvdlite's ops.
_OPS = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min,
        "product": hvd.Product, "prod": hvd.Product}


def _hvd_op(reduce_op: Any) -> Any:
    if reduce_op is None:
        return hvd.Average
    name = reduce_op if isinstance(reduce_op, str) else getattr(reduce_op, "name", str(reduce_op))
    op = _OPS.get(str(name).lower().rsplit(".", 1)[-1])
    if op is None:
        raise ValueError(f"HvdliteStrategy.reduce: unsupported reduce_op {reduce_op!r} on rank {hvd.rank()}; "
                         f"use one of {sorted(_OPS)} (or torch.distributed.ReduceOp.SUM/MAX/MIN/PRODUCT/AVG)")
    return op


def _process_set(group: Any, what: str) -> Any:
    """Lightning's ``group``: None (all ranks) or an hvdlite ProcessSet; torch process groups do not exist here."""
    if group is None:
        return hvd.global_process_set
    if isinstance(group, hvd.ProcessSet):
        return group
    raise ValueError(f"HvdliteStrategy.{what}: group={group!r} on rank {hvd.rank()}: hvdlite has no "
                     f"torch.distributed process groups; pass group=None (every rank) or an hvdlite ProcessSet "
                     f"(hvdlite.torch.add_process_set([...]))")


class _StackedGather(torch.autograd.Function):
    """all_gather with gradients, with DDP's convention: each rank's input gradient is the SUM over ranks of
    the gradient of its slice (hvd.allgather's own gradient averages, Horovod's convention)."""

    @staticmethod
    def forward(ctx: Any, tensor: Tensor, process_set: Any) -> Tensor:
        ctx.process_set = process_set
        return hvd.allgather(tensor.unsqueeze(0).contiguous(), process_set=process_set)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        summed = hvd.allreduce(grad.contiguous(), op=hvd.Sum, process_set=ctx.process_set)
        return summed[ctx.process_set.rank()], None


class HvdliteEnvironment(ClusterEnvironment):
    """The processes were started by mpiexec, hvdlite-run or srun; hvdlite (MPI) already connects them, so
    there is no rendezvous address or port and Lightning may not change the ranks."""

    @property
    def creates_processes_externally(self) -> bool:
        return True

    @property
    def main_address(self) -> str:
        return ""  # nothing rendezvous-based is started: hvdlite's MPI runtime connects the ranks

    @property
    def main_port(self) -> int:
        return 0

    @staticmethod
    def detect() -> bool:
        return hvd.is_initialized()

    def world_size(self) -> int:
        return hvd.size()

    def set_world_size(self, size: int) -> None:
        if size != hvd.size():
            _log.debug("HvdliteEnvironment: world size %d asked for, the launcher started %d", size, hvd.size())

    def global_rank(self) -> int:
        return hvd.rank()

    def set_global_rank(self, rank: int) -> None:
        if rank != hvd.rank():
            _log.debug("HvdliteEnvironment: rank %d asked for, the launcher made this rank %d", rank, hvd.rank())

    def local_rank(self) -> int:
        return hvd.local_rank()

    def node_rank(self) -> int:
        return hvd.cross_rank()


class HvdliteStrategy(ParallelStrategy):
    """``Trainer(strategy=HvdliteStrategy())`` or, after ``import hvdlite.lightning``, ``strategy="hvdlite"``: each
    optimizer wrapped in ``hvdlite.torch.DistributedOptimizer``, synchronized after backward (docs/lightning.md)."""

    strategy_name = "hvdlite"
    model: Any  # Lightning's properties (mypy sees the base as Any)
    optimizers: list[Any]

    def __init__(self, accelerator: Optional[Any] = None, checkpoint_io: Optional[CheckpointIO] = None,
                 precision_plugin: Optional[Precision] = None, compression: Any = hvd.Compression.none,
                 gradient_predivide_factor: float = 1.0) -> None:
        if not hvd.is_initialized():
            hvd.init()
        super().__init__(accelerator=accelerator, parallel_devices=None,
                         cluster_environment=HvdliteEnvironment(), checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._compression = compression
        self._gradient_predivide_factor = float(gradient_predivide_factor)
        self._accumulating = False  # inside block_backward_sync: a backward whose gradients are not reduced yet
        self._skip_sync: Optional[contextlib.ExitStack] = None
        self.set_world_ranks()

    # -- the job: hvdlite's ranks (global_rank, world_size... are ParallelStrategy's, from the environment) --
    @property
    def is_distributed(self) -> bool:  # read by Lightning's connector: inject the DistributedSampler
        return True

    @property
    def root_device(self) -> torch.device:
        devices = self.parallel_devices or [torch.device("cpu")]
        if devices[0].type == "cuda":  # one GPU per process, chosen by local rank (Horovod's convention)
            return torch.device("cuda", hvd.local_rank() % torch.cuda.device_count())
        return torch.device(devices[0].type)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": hvd.size(), "rank": hvd.rank()}

    def set_world_ranks(self) -> None:  # called by Lightning's connector; the ranks are the launcher's
        rank_zero_only.rank = utils_rank_zero_only.rank = hvd.rank()  # type: ignore[attr-defined]

    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # -- set-up: same weights everywhere, optimizers wrapped ------------------------------------------
    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        if self._layer_sync is not None:
            raise ValueError("Trainer(sync_batchnorm=True) converts the model to torch's SyncBatchNorm, which needs "
                             "torch.distributed; hvdlite does not start it. Build the model with "
                             "hvdlite.torch.SyncBatchNorm layers instead and leave sync_batchnorm off.")
        self.accelerator.setup(trainer)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        # every entry point (fit, validate, test, predict) starts from rank 0's weights, as DDP's does
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            self.setup_optimizers(trainer)
            self._wrap_optimizers(trainer.accumulate_grad_batches)
        self.setup_precision_plugin()
        if fitting:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _wrap_optimizers(self, accumulate_grad_batches: int) -> None:
        assert self.lightning_module is not None
        wrapped = []
        for opt in self.optimizers:
            opt = opt.optimizer if isinstance(opt, LightningOptimizer) else opt
            if opt.state:  # state only: a fresh optimizer takes no zero-gradient step (fit equals one process)
                hvd.broadcast_optimizer_state(opt, root_rank=0)
            mine = {p for group in opt.param_groups for p in group["params"]}
            named = [(name, p) for name, p in self.lightning_module.named_parameters() if p in mine]
            dist = hvd.DistributedOptimizer(opt, named_parameters=named if len(named) == len(mine) else None,
                                            compression=self._compression,
                                            backward_passes_per_step=accumulate_grad_batches,
                                            gradient_predivide_factor=self._gradient_predivide_factor)
            for config in self.lr_scheduler_configs:  # schedulers follow the optimizer object they step
                if getattr(config.scheduler, "optimizer", None) is opt:
                    config.scheduler.optimizer = dist
            wrapped.append(dist)
        self.optimizers = wrapped
        # The gradients are reduced right after backward (post_backward), where DDP has them reduced: the
        # precision plugin clips/unscales them before step(), and step() runs the closure (the backward).
        self._skip_sync = contextlib.ExitStack()
        for dist in wrapped:
            self._skip_sync.enter_context(dist.skip_synchronize())

    # -- gradients ----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Backward passes Lightning accumulates reduce nothing (backward_passes_per_step counts them)."""
        self._accumulating = True
        try:
            yield None
        finally:
            self._accumulating = False

    def post_backward(self, closure_loss: Tensor) -> None:
        if self._accumulating:
            return
        for opt in self.optimizers:
            opt = opt.optimizer if isinstance(opt, LightningOptimizer) else opt
            # only optimizers whose parameters got gradients (manual optimization may step one of several)
            if opt.gradients_pending:
                opt.synchronize()

    # -- collectives: reduce (self.log(sync_dist=True)), all_gather, broadcast, barrier ---------------
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Any] = "mean") -> Union[Tensor, Any]:
        """Reduce ``tensor`` over the ranks (mean by default); anything but a tensor is returned as is."""
        if not isinstance(tensor, Tensor):
            return tensor
        op, process_set = _hvd_op(reduce_op), _process_set(group, "reduce")
        if op is hvd.Average and not (tensor.is_floating_point() or tensor.is_complex()):
            summed = hvd.allreduce(tensor, op=hvd.Sum, process_set=process_set)
            return (summed / process_set.size()).to(tensor.dtype)  # DDP's mean of integers truncates too
        return hvd.allreduce(tensor, op=op, process_set=process_set)

    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Every rank's ``tensor`` stacked along a new first dimension (world_size, *tensor.shape), as DDP's."""
        process_set = _process_set(group, "all_gather")
        if sync_grads:
            return _StackedGather.apply(tensor, process_set)
        with torch.no_grad():
            return hvd.allgather(tensor.unsqueeze(0).contiguous(), process_set=process_set)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return hvd.broadcast_object(obj, root_rank=src)

    def barrier(self, name: Optional[str] = None) -> None:
        hvd.barrier()

    # -- registry and teardown ------------------------------------------------------------------------
    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(cls.strategy_name, cls,
                                       description="data parallel over hvdlite (launch with mpiexec, "
                                                   "hvdlite-run or srun)")

    def teardown(self) -> None:
        if self._skip_sync is not None:
            self._skip_sync.close()
            self._skip_sync = None
        super().teardown()
