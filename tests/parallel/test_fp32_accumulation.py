"""bf16/fp16 on the wire, float32 sums (Compression.bf16_fp32acc and its variants): every element is the rank-order
float32 sum of each rank's contribution rounded once to the wire dtype, scaled, and rounded once to the gather
dtype; checked bit for bit against that reference (made here with torch's own casts) on the MPI path and the
torch.distributed (gloo) plane (``cpu_operations="gloo"``, set per test: no second spawn), under very different
fusion, chunk and cycle settings; through allreduce(compression=), grouped ops of mixed dtypes, the
DistributedOptimizer (buckets, per-parameter groups, the comm hook) and process sets; and the refusals
(Min/Max/Product/Adasum, bool, sparse gradients, ZeRO) with their messages. TensorFlow's tape, Keras optimizer
and sparse refusal: tests/parallel/test_tf_policy.py (TensorFlow is imported there already)."""
from __future__ import annotations

import pytest
import torch

import hvdlite.torch as hvd
from hvdlite.torch import comm_hooks

MPI_SIZES = (2, 3, 4)
SPAWN_TIMEOUT = 300
PLANES = ("mpi", "gloo")
#: everything fused in big chunks, versus nothing fused, 256-byte chunks and a slow cycle
BIG = dict(fusion_threshold_bytes=64 << 20, allreduce_chunk_bytes=64 << 20, cycle_time_ms=0.5)
SMALL = dict(fusion_threshold_bytes=0, allreduce_chunk_bytes=256, cycle_time_ms=5.0)
WIRE = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
C = hvd.Compression


def reference(everyone: torch.Tensor, compression: type, post: float = 1.0, pre: float = 1.0) -> torch.Tensor:
    """What every rank must get (float32): rank r's row ``everyone[r]`` times ``pre`` (in double, rounded to
    float32), rounded to the wire dtype; summed in float32 in rank order; times ``post`` (in double); rounded
    to the gather dtype."""
    acc = compression.accumulation
    wire, gather = WIRE[acc.wire], WIRE[acc.gather]
    rows = [(row.double() * pre).float().to(wire).float() for row in everyone]
    total = rows[0].clone()
    for row in rows[1:]:
        total = total + row
    total = (total.double() * post).float()
    return total.to(gather).float()


def gathered(t: torch.Tensor, name: str) -> torch.Tensor:
    return hvd.allgather(t.reshape(1, -1), name=name)


def same_everywhere(t: torch.Tensor, name: str) -> None:
    rows = gathered(t.reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t, name)
    assert all(torch.equal(rows[0], r) for r in rows[1:]), f"{name}: ranks got different bits"


def test_bits_do_not_depend_on_fusion_chunks_cycle_or_plane(reinit, rank: int, size: int) -> None:
    """Averages of random tensors of every floating dtype, with each accumulating compression, all in flight at
    once: the reference's bits under both settings, on both planes, with deterministic=True (which it
    coincides with in order but not in precision), on every rank; scale factors applied in double."""
    gen = torch.Generator().manual_seed(rank)
    dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
    xs = [(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-2, 3, (n,), generator=gen)).to(d)
          for n, d in zip((5, 300, 1031, 517), dtypes)]
    everyone = [gathered(x.float(), f"fus.all.{i}") for i, x in enumerate(xs)]
    comps = [C.bf16_fp32acc, C.fp16_fp32acc, C.bf16_fp32acc_fp32gather]
    want = [[reference(e, c, post=1.0 / size).to(x.dtype) for e, x in zip(everyone, xs)] for c in comps]
    for label, settings in (("big", dict(BIG, cpu_operations="mpi")), ("small", dict(SMALL, cpu_operations="mpi")),
                            ("gloo", dict(BIG, cpu_operations="gloo")), ("det", dict(SMALL, deterministic=True))):
        reinit(**settings)
        handles = [[hvd.allreduce_async_(x.clone(), name=f"fus.{label}.{k}.{i}", accumulation=c.accumulation)
                    for i, x in enumerate(xs)] for k, c in enumerate(comps)]
        gots = [[hvd.synchronize(h) for h in row] for row in handles]
        for k, row in enumerate(gots):
            for i, got in enumerate(row):
                assert got.dtype == xs[i].dtype and torch.equal(got, want[k][i]), (label, comps[k].__name__, i)
        same_everywhere(torch.cat([g.double() for row in gots for g in row]), f"fus.same.{label}")
        if label == "small":  # prescale and postscale are applied in double, rounded once
            for c in comps:
                got = hvd.allreduce(xs[0].float(), op=hvd.Sum, compression=c, prescale_factor=0.1,
                                    postscale_factor=3.0, name=f"fus.scaled.{c.__name__}")
                assert torch.equal(got, reference(everyone[0], c, post=3.0, pre=0.1)), c.__name__


def test_exact_sums_mixed_dtypes_and_process_sets(reinit, rank: int, size: int) -> None:
    """On the MPI path, then the gloo plane: (1) integer-valued bf16 contributions: float32 accumulation is
    exact (fp32 gather: the exact sum; bf16 gather: the exact sum rounded once), where a reduction in bf16
    rounds after every addition and loses the ones; (2) one grouped op of float32, bfloat16, float16, float64
    and int32 tensors: the floats follow the rule, the integers are summed exactly; (3) even and odd ranks,
    each reducing over its own process set: the set's reference."""
    for plane in PLANES:
        reinit(cpu_operations=plane, **SMALL)
        x = torch.ones(1000, dtype=torch.float32)
        x[::7] = 256.0 if rank == 0 else 1.0  # 256 + 1 + 1 + 1: bf16 has no 257 or 259
        x[1::7] = float(rank - 100)
        exact = gathered(x, f"int.all.{plane}").double().sum(0)
        got32 = hvd.allreduce(x, op=hvd.Sum, compression=C.bf16_fp32acc_fp32gather, name=f"int.f32.{plane}")
        assert torch.equal(got32.double(), exact), plane
        assert got32[0].item() == 255 + size, plane  # 256 and the other ranks' ones, none lost
        got16 = hvd.allreduce(x, op=hvd.Sum, compression=C.bf16_fp32acc, name=f"int.bf16.{plane}")
        assert torch.equal(got16, exact.float().to(torch.bfloat16).float()), plane
        same_everywhere(got16, f"int.same.{plane}")

        gen = torch.Generator().manual_seed(10 + rank)
        xs = [torch.randn(97, generator=gen).to(d) for d in (torch.float32, torch.bfloat16, torch.float16,
                                                              torch.float64)]
        xs.append(torch.arange(50, dtype=torch.int32) * (rank + 1))
        got = hvd.grouped_allreduce(xs, op=hvd.Sum, compression=C.bf16_fp32acc, name=f"mixed.{plane}")
        for i, (x, g) in enumerate(zip(xs[:4], got)):
            assert torch.equal(g, reference(gathered(x.float(), f"mixed.all.{plane}.{i}"), C.bf16_fp32acc).to(x.dtype))
        assert torch.equal(got[4], torch.arange(50, dtype=torch.int32) * sum(range(1, size + 1)))

        sets = [hvd.add_process_set(list(range(start, size, 2))) for start in (0, 1)]
        mine = sets[rank % 2]
        x = torch.randn(501, generator=torch.Generator().manual_seed(rank)) * 10.0 ** rank
        everyone = hvd.allgather(x.reshape(1, -1), name=f"ps.all.{plane}", process_set=mine)
        got = hvd.allreduce(x, compression=C.bf16_fp32acc, name=f"ps.{plane}", process_set=mine)
        assert torch.equal(got, reference(everyone, C.bf16_fp32acc, post=1.0 / mine.size())), plane
        for ps in sets:
            hvd.remove_process_set(ps)


def test_refusals_name_the_op_dtype_and_fix() -> None:
    """Min/Max are exact in half precision already (Compression.bf16 reduces them exactly), Product and Adasum
    are not sums: each is refused at submit with the reason; so are bool tensors and ZeRO's reduce-scatter."""
    x = torch.ones(4)
    for op, pattern in ((hvd.Min, "hvd.Min and hvd.Max of half-precision values are exact"),
                        (hvd.Max, "hvd.Max has nothing to accumulate"), (hvd.Product, "hvd.Product has nothing"),
                        (hvd.Adasum, "hvd.Adasum has nothing")):
        with pytest.raises(ValueError, match=pattern):
            hvd.allreduce(x, op=op, compression=C.bf16_fp32acc, name=f"refuse.{op}")
    with pytest.raises(TypeError, match=r"allreduce 'allreduce.refuse.bool': float32 accumulation cannot carry bool"):
        hvd.grouped_allreduce([x, torch.ones(3, dtype=torch.bool)], op=hvd.Sum, compression=C.bf16_fp32acc,
                              name="refuse.bool")
    model = torch.nn.Linear(3, 2)
    with pytest.raises(ValueError, match="ZeroRedundancyOptimizer: compression=BF16FP32AccCompressor"):
        hvd.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, compression=C.bf16_fp32acc, lr=0.1)
    assert hvd.allreduce(x, op=hvd.Sum, compression=C.bf16_fp32acc, name="refuse.after").tolist() == \
        [float(hvd.size())] * 4  # nothing was left pending by the refusals


class _Net(torch.nn.Module):
    def __init__(self, dense: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights on every rank
        self.emb = torch.nn.Embedding(20, 6, sparse=True)
        self.fc = torch.nn.Linear(6, 3) if dense else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        out = self.emb(idx)
        return (self.fc(out) if self.fc is not None else out[:, :3]).sum(0)


def _backward(net: _Net, rank: int) -> None:
    gen = torch.Generator().manual_seed(100 + rank)
    idx = torch.randint(0, 20, (5,), generator=gen)
    (net(idx) * torch.randn(3, generator=gen) * 10.0 ** (rank - 1)).sum().backward()


@pytest.mark.parametrize("plane", PLANES)
def test_distributed_optimizer_gets_the_reference_average(reinit, plane: str, rank: int) -> None:
    """DistributedOptimizer(compression=bf16_fp32acc): the buckets, per-parameter groups and the comm hook all
    leave each gradient equal to the reference average of every rank's; a sparse gradient is refused without
    sparse_as_dense and densified with it."""
    reinit(cpu_operations=plane)
    local = _Net()
    _backward(local, rank)
    want = {n: reference(gathered(p.grad.to_dense(), f"opt.all.{plane}.{n}"), C.bf16_fp32acc,
                         post=1.0 / hvd.size()).view_as(p) for n, p in local.named_parameters()}
    for variant in ("buckets", "groups", "hook"):
        net = _Net()
        extra: dict = dict(compression=C.bf16_fp32acc)
        if variant == "groups":
            extra["groups"] = [[p] for p in net.parameters()]
        if variant == "hook":
            extra = {}
        opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.0), net.named_parameters(),
                                       sparse_as_dense=True, **extra)
        if variant == "hook":
            opt.register_comm_hook(None, comm_hooks.bf16_fp32acc_compress_hook)
        _backward(net, rank)
        opt.synchronize()
        for n, p in net.named_parameters():
            if variant != "hook" or n != "emb.weight":  # a hook reduces buckets: sparse gradients keep their path
                assert torch.equal(p.grad.to_dense(), want[n]), (variant, n)
    sparse_only = _Net(dense=False)  # only the sparse gradient: nothing else is left pending by the refusal
    opt = hvd.DistributedOptimizer(torch.optim.SGD(sparse_only.parameters(), lr=0.0),
                                   sparse_only.named_parameters(), compression=C.bf16_fp32acc)
    with pytest.raises(ValueError, match=r"the gradient of 'emb.weight' is sparse.*sparse_as_dense=True"):
        _backward(sparse_only, rank)
        opt.synchronize()
