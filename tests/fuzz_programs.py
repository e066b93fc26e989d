"""Seeded random collective programs for the fuzz suite, and their exact numpy references.

A program is a list of steps every rank walks through in the same order. Each op's inputs are drawn from
(seed, step, op, rank) alone, so every rank can rebuild every other rank's inputs and check its own results
exactly. Values are small integers (and power-of-two scale factors) so that every float result is exact,
and Average inputs are chosen so that the quotient is exact.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from hvdlite.core.engine.deterministic import slices
from hvdlite.core.reduce_ops import bf16_to_f32, f32_to_bf16

DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "uint64", "int64",
          "float16", "bfloat16", "float32", "float64", "bool")
FLOATS = ("float16", "bfloat16", "float32", "float64")
REDUCE_KINDS = ("allreduce", "reducescatter")


@dataclasses.dataclass
class Op:
    """One collective, as every rank of the program sees it."""

    kind: str                     # allreduce allgather broadcast alltoall reducescatter barrier
    members: tuple                # world ranks of its process set, sorted
    pset: Optional[tuple]         # None: the global set; else the ranks of a registered set
    name: Optional[str]           # None: a generated name
    dtypes: tuple = ()            # one per tensor
    shapes: tuple = ()            # one per tensor (allgather/alltoall: the shape beyond the first dimension)
    grouped: bool = False
    op: str = "Sum"
    pre: float = 1.0
    post: float = 1.0
    root: int = 0                 # set rank of the broadcast root (passed as root_rank=members[root])
    splits: Optional[dict] = None  # alltoall: world rank -> its splits (None: even)
    rows: Optional[dict] = None   # allgather/alltoall: world rank -> first dimension of each tensor
    inplace: bool = False
    scalar: bool = False          # allgather of a 0-d array (it counts as one row)
    key: tuple = ()               # (seed, step, index): the source of its inputs

    def describe(self) -> str:
        where = "global" if self.pset is None else f"set {list(self.pset)}"
        return (f"{self.kind}{'(grouped)' if self.grouped else ''} name={self.name!r} {where} dtypes="
                f"{list(self.dtypes)} shapes={list(self.shapes)} op={self.op} pre={self.pre} post={self.post} "
                f"root={self.root} inplace={self.inplace}")


@dataclasses.dataclass
class Step:
    what: str                     # "sync", "batch", "add", "remove", "join"
    ops: list = dataclasses.field(default_factory=list)
    ranks: tuple = ()             # add/remove: the set; join: the ranks that join now
    sync_at: int = -1             # batch: index of the op each rank runs synchronously (-1: none)
    ordered: bool = False         # batch: every rank submits in program order (generated names allowed)


# -- values ---------------------------------------------------------------------------------------------
def _values(rng: np.random.Generator, dtype: str, shape: tuple, op: str) -> np.ndarray:
    if dtype == "bool":
        return rng.integers(0, 2, size=shape).astype(bool)
    unsigned = dtype.startswith("uint")
    if op == "Product":
        choices = [0, 1, 2] if unsigned else [-2, -1, 1, 2]
        return np.asarray(rng.choice(choices, size=shape), dtype=np.float64)
    lo = 0 if unsigned else -4
    return rng.integers(lo, 5, size=shape).astype(np.float64)


def storage(values: np.ndarray, dtype: str) -> np.ndarray:
    """The array a rank passes in: bfloat16 as uint16 bits (with a dtype hint), else the dtype itself."""
    if dtype == "bfloat16":
        return f32_to_bf16(np.asarray(values, dtype=np.float32)).reshape(np.shape(values))
    return np.asarray(values).astype(dtype)


def as_float(result: np.ndarray, dtype: str) -> np.ndarray:
    """A result as float64 (bool as bool), whatever its storage."""
    a = np.asarray(result)
    if dtype == "bfloat16":
        return bf16_to_f32(a.view(np.uint16).reshape(-1)).astype(np.float64).reshape(a.shape)
    return a if dtype == "bool" else a.astype(np.float64)


def inputs(op: Op, rank: int) -> list[np.ndarray]:
    """The values (float64 or bool) that ``rank`` submits for ``op``."""
    out = []
    for i, (dtype, shape) in enumerate(zip(op.dtypes, op.shapes)):
        rng = np.random.default_rng([*op.key, i, rank])
        if op.kind in ("allgather", "alltoall"):
            shape = (op.rows[rank][i],) + tuple(shape)
        out.append(_values(rng, dtype, shape, op.op))
    if op.kind in REDUCE_KINDS and op.op == "Average":  # make every member's sum divisible by the set size
        n = len(op.members)
        if rank == op.members[-1]:
            for i, dtype in enumerate(op.dtypes):
                others = sum(inputs_one(op, r, i) for r in op.members[:-1]) if n > 1 else 0
                short = np.mod(others + out[i], n)
                out[i] = out[i] + np.mod(n - short, n) if dtype.startswith("uint") else out[i] - short
    return out


def inputs_one(op: Op, rank: int, i: int) -> np.ndarray:
    return inputs(op, rank)[i]


# -- references -------------------------------------------------------------------------------------------
def _reduce(op: Op, per_rank: list[np.ndarray], dtype: str, active: int) -> np.ndarray:
    if dtype == "bool":
        stack = np.stack(per_rank)
        return stack.all(axis=0) if op.op in ("Min", "Product") else stack.any(axis=0)
    stack = np.stack([x * op.pre for x in per_rank])
    combine = {"Sum": np.sum, "Average": np.sum, "Min": np.min, "Max": np.max, "Product": np.prod}[op.op]
    total = combine(stack, axis=0)
    if op.op == "Average":
        total = total / active
    return total * op.post


def expected(op: Op, rank: int, active: Optional[tuple] = None) -> Any:
    """What ``rank`` must get back (float64/bool values; a list for grouped ops). ``active``: the ranks that
    have not joined (the others stand in with zeros or no rows)."""
    members = op.members
    live = members if active is None else tuple(r for r in members if r in active)
    everyone = {r: inputs(op, r) for r in live}
    me = members.index(rank)
    results = []
    for i, dtype in enumerate(op.dtypes):
        if op.kind == "allreduce":
            per = [everyone[r][i] for r in live]
            results.append(_reduce(op, per, dtype, len(members)))
        elif op.kind == "allgather":
            results.append(np.concatenate([everyone[r][i] for r in live]))
        elif op.kind == "broadcast":
            results.append(everyone[members[op.root]][i])
        elif op.kind == "reducescatter":
            full = _reduce(op, [everyone[r][i] for r in members], dtype, len(members))
            rows = slices(full.shape[0], len(members))  # Horovod's split (pinned by test_core_collectives)
            results.append(full[sum(rows[:me]):sum(rows[:me + 1])])
        elif op.kind == "alltoall":
            pieces, recv = [], []
            for r in members:
                splits = split_of(op, r)
                start = sum(splits[:me])
                pieces.append(everyone[r][i][start:start + splits[me]])
                recv.append(splits[me])
            results.append((np.concatenate(pieces), np.array(recv)))
    return results if op.grouped else (results[0] if results else None)


def split_of(op: Op, rank: int) -> list[int]:
    n = len(op.members)
    if op.splits is None:
        return [op.rows[rank][0] // n] * n
    return list(op.splits[rank])


# -- generation -------------------------------------------------------------------------------------------
class Generator:
    """Builds one program for a world of ``size`` ranks from ``seed``."""

    def __init__(self, seed: int, size: int, join_allows_allgather_broadcast: bool = False) -> None:
        self.seed, self.size = seed, size
        #: What the others run between joins: allreduce (Horovod's rule), or allgather and broadcast too
        #: under the join_allows_allgather_broadcast setting.
        self.join_kinds = ("allreduce", "allgather", "broadcast") if join_allows_allgather_broadcast \
            else ("allreduce",)
        self.rng = np.random.default_rng([seed, size, 7919])
        self.sets: list[tuple] = []
        self.pool: list[Op] = []  # earlier ops whose name and signature may be reused (cache hits)

    def program(self) -> list[Step]:
        rng, steps = self.rng, []
        for index in range(int(rng.integers(4, 11))):
            roll = rng.random()
            if roll < 0.08 and len(self.sets) < 3:
                ranks = self._new_set()
                if ranks is not None:
                    self.sets.append(ranks)
                    steps.append(Step("add", ranks=ranks))
                    continue
            if roll < 0.13 and self.sets:
                ranks = self.sets.pop(int(rng.integers(len(self.sets))))
                steps.append(Step("remove", ranks=ranks))
                continue
            if roll < 0.5:
                steps.append(Step("sync", [self._op(index, 0, sync=True)]))
            else:
                steps.append(self._batch(index))
        if rng.random() < 0.35:
            steps.extend(self._joins(len(steps)))
        for ranks in self.sets:  # leave the registry as found
            steps.append(Step("remove", ranks=ranks))
        return steps

    def _new_set(self) -> Optional[tuple]:
        for _ in range(5):
            k = int(self.rng.integers(1, self.size))
            ranks = tuple(sorted(self.rng.choice(self.size, size=k, replace=False).tolist()))
            if ranks not in self.sets:
                return ranks
        return None

    def _batch(self, index: int) -> Step:
        rng = self.rng
        count = int(rng.integers(1, 7))
        ordered = bool(rng.random() < 0.25)
        ops: list[Op] = []
        used: set = set()
        for i in range(count):
            op = self._op(index, i, sync=False)
            if op.name is None and not ordered:
                op.name = f"fz{self.seed}.{index}.{i}"
            if (op.pset, op.name) in used:
                op.name = f"fz{self.seed}.{index}.{i}.b"
            if ops and rng.random() < 0.3:  # one name in two disjoint process sets at once (one table per set)
                other = ops[int(rng.integers(len(ops)))]
                if not set(other.members) & set(op.members) and other.name is not None \
                        and (op.pset, other.name) not in used:
                    op.name = other.name
            used.add((op.pset, op.name))
            ops.append(op)
        sync_at = int(rng.integers(count)) if rng.random() < 0.3 else -1
        if sync_at >= 0 and ops[sync_at].name is None:
            sync_at = -1
        return Step("batch", ops, sync_at=sync_at, ordered=ordered)

    def _op(self, index: int, i: int, sync: bool, kinds: Optional[tuple] = None,
            members: Optional[tuple] = None) -> Op:
        rng = self.rng
        key = (self.seed, index, i)
        if kinds is None and self.pool and rng.random() < 0.25:  # same name and signature again
            old = self.pool[int(rng.integers(len(self.pool)))]
            if old.pset is None or old.pset in self.sets:
                return dataclasses.replace(old, key=key)
        kinds = kinds or ("allreduce", "allreduce", "allgather", "broadcast", "alltoall", "reducescatter",
                          "barrier")
        kind = kinds[int(rng.integers(len(kinds)))]
        pset = None
        if members is None and self.sets and rng.random() < 0.35:
            pset = self.sets[int(rng.integers(len(self.sets)))]
        members = members or pset or tuple(range(self.size))
        if kind == "barrier":
            if sync:
                return Op("barrier", members, pset, None, key=key)
            op = self._op(index, i, sync, kinds=("allreduce",), members=members)  # no async barrier
            op.pset, op.members = pset, members
            return op
        grouped = kind in ("allreduce", "allgather", "reducescatter") and rng.random() < 0.35
        ntensors = int(rng.integers(0, 4)) if grouped else 1
        op_name = "Sum"
        if kind in REDUCE_KINDS:
            op_name = ["Sum", "Sum", "Average", "Min", "Max", "Product"][int(rng.integers(6))]
        dtypes = tuple(self._dtype(op_name) for _ in range(ntensors))
        if kind == "reducescatter" and dtypes:
            dtypes = (dtypes[0],) * ntensors
        shapes = tuple(self._shape(kind) for _ in range(ntensors))
        op = Op(kind, members, pset, None, dtypes, shapes, grouped, op_name, key=key)
        if kind in REDUCE_KINDS and op_name in ("Sum", "Average", "Min", "Max") and "bool" not in dtypes:
            floats = all(d in FLOATS for d in dtypes)
            op.pre = float(rng.choice([1.0, 2.0] + ([0.5] if floats and op_name != "Average" else [])))
            op.post = float(rng.choice([1.0, 2.0] + ([0.5, 0.25] if floats else [])))
        if kind == "broadcast":
            op.root = int(rng.integers(len(members)))
            op.inplace = bool(rng.random() < 0.3)
        if kind == "allreduce" and not grouped:
            op.inplace = bool(rng.random() < 0.2)
        if kind in ("allgather", "alltoall"):
            n = len(members)
            op.rows = {r: tuple(int(rng.integers(0, 4)) * (1 if kind == "allgather" else n)
                                for _ in range(ntensors)) for r in members}
            if kind == "alltoall" and rng.random() < 0.6:
                op.splits = {}
                for r in members:
                    total = int(rng.integers(0, 6))
                    cuts = np.sort(rng.integers(0, total + 1, size=n - 1))
                    op.splits[r] = tuple(np.diff(np.concatenate(([0], cuts, [total]))).astype(int).tolist())
                    op.rows[r] = (total,)
        if kind == "allgather" and not grouped and shapes == ((),) and rng.random() < 0.3:
            op.scalar, op.rows = True, {r: (1,) for r in members}
        if rng.random() < 0.6:
            op.name = f"fz{self.seed}.{index}.{i}" if rng.random() < 0.7 else f"pool.{int(rng.integers(4))}"
            if op.name.startswith("pool."):
                op.name = f"{op.name}.{kind}.{'_'.join(map(str, members))}.{self.seed}.{index}.{i}"
            self.pool.append(op)
        return op

    def _dtype(self, op_name: str) -> str:
        choices = DTYPES if op_name != "Average" else DTYPES[:-1]
        return choices[int(self.rng.integers(len(choices)))]

    def _shape(self, kind: str) -> tuple:
        rng = self.rng
        if kind in ("allgather", "alltoall"):
            return tuple(int(rng.integers(0, 3)) for _ in range(int(rng.integers(0, 3))))
        ndim = int(rng.integers(1 if kind == "reducescatter" else 0, 4))
        return tuple(int(rng.integers(0, 5)) for _ in range(ndim))

    def _joins(self, index: int) -> list[Step]:
        """Ranks join in random groups; between groups the others run join-tolerant global ops; the last
        rank runs at least one op alone, so it is the one join() returns everywhere."""
        rng = self.rng
        order = rng.permutation(self.size).tolist()
        last = order[-1]
        cuts = sorted(set(rng.integers(1, self.size, size=int(rng.integers(1, self.size))).tolist())) \
            if self.size > 2 else [1]
        groups = [tuple(order[a:b]) for a, b in zip([0] + cuts, cuts + [self.size - 1])] + [(last,)]
        groups = [g for g in groups if g]
        steps, active = [], set(range(self.size))
        for g, group in enumerate(groups):
            if g:
                for k in range(int(rng.integers(1, 3))):
                    op = self._op(index + g, k, sync=True, kinds=self.join_kinds,
                                  members=tuple(range(self.size)))
                    op.grouped, op.op, op.pre, op.post, op.inplace = op.grouped and op.kind != "broadcast", \
                        "Sum", 1.0, 1.0, False
                    if op.kind == "broadcast":
                        op.root = sorted(active)[int(rng.integers(len(active)))]
                    op.name = f"fz{self.seed}.j{g}.{k}"  # only the active ranks call it: never generated
                    steps.append(Step("sync", [op], ranks=tuple(sorted(active))))
            steps.append(Step("join", ranks=group, ops=[last]))
            active -= set(group)
        return steps
