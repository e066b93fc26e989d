"""Negotiation: every rank agrees, identically, what runs: the round's flags, the vote and the explaining round."""
from __future__ import annotations

import functools
import pickle
import time
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import numpy as np

from . import polling
from .callsite import grouped
from .chunks import start_allreduce
from .messages import RankMessage, name_table
from .mpi import counts_displacements
from .names import generated
from .requests import FIELD_LABELS, Kind, Request, Response, Signature, shared
from .stalls import Stalled, Stop, shutdown_message, submitted_at

if TYPE_CHECKING:
    from .loop import Engine

FLAG_FULL = 1        # some rank has requests without a cache bit: a vote this cycle (vote_round)
FLAG_SHUTDOWN = 2    # some rank is shutting down
FLAG_BUSY = 4        # some rank has requests pending (idle ranks keep cycling promptly)
FLAG_EXCHANGE = 8    # rank 0: exchange straggler times at the next cycle with agreed ops (engine/stragglers.py)
FLAG_EXPLAIN = 16    # some rank needs the explaining round (stall check, join, shutdown, autotune's switch)
NEGOTIATION_POLL_CAP = 0.001  # seconds between polls of a negotiation message exchange


def allgather_messages(comm: Any, msg: RankMessage, sizes_out: list[Any]) -> list[RankMessage]:
    """Every rank's message, in rank order: the sizes (into ``sizes_out``), then the bytes, each an arrival wait."""
    payload = np.frombuffer(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    size = comm.Get_size()
    sizes = np.empty(size, dtype=np.int64)
    polling.wait(comm.Iallgather(np.array([payload.size], dtype=np.int64), sizes), NEGOTIATION_POLL_CAP,
                 arrival=True)
    sizes_out[:] = sizes.tolist()
    sizes, displs = counts_displacements(sizes)
    data = np.empty(int(sizes.sum()), dtype=np.uint8)
    polling.wait(comm.Iallgatherv(payload, [data, (sizes, displs)]), NEGOTIATION_POLL_CAP, arrival=True)
    return [pickle.loads(data[d:d + n].tobytes()) for d, n in zip(displs.tolist(), sizes.tolist())]


#: What join() lets run on the other ranks by default (Horovod's rule); allgather and broadcast join them with
#: the join_allows_allgather_broadcast setting.
JOIN_TOLERANT = frozenset({Kind.ALLREDUCE, Kind.BARRIER})
JOIN_TOLERANT_PERMISSIVE = JOIN_TOLERANT | {Kind.ALLGATHER, Kind.BROADCAST}


def decide(messages: Sequence[RankMessage], members_of: dict[int, list[int]], world_size: int,
           join_tolerant: frozenset[Kind] = JOIN_TOLERANT) -> tuple[list[Response], list[Stalled]]:
    """From every rank's message, the responses to run now and what is stalled; every rank calls it with the same
    ``messages`` and agreed ``join_tolerant`` (the kinds that run while ranks have joined): the same answer."""
    joined = {r for r, m in enumerate(messages) if m.join_cycle >= 0}
    responses: list[Response] = []
    # One table per process set: the same name may be in use in several sets at once. Each entry maps the ranks
    # that submitted the name, in rank order, to the request's position in their message.
    sigs_of = [msg.signatures() for msg in messages]
    table: dict[tuple[int, str], dict[int, int]] = {}
    for rank, msg in enumerate(messages):
        for index, (name, sig) in enumerate(zip(msg.names, sigs_of[rank])):
            table.setdefault((sig.ps_id, name), {})[rank] = index

    stalled: list[Stalled] = []
    join: Optional[tuple[str, Signature]] = None  # the join's name and signature
    for key, entries in table.items():
        ps_id, name = key
        first_rank = next(iter(entries))  # the lowest: ranks were entered in order
        first_sig = sigs_of[first_rank][entries[first_rank]]
        kind = first_sig.kind
        if kind is Kind.JOIN:
            join = (name, first_sig)
            continue
        members = members_of.get(ps_id)
        # The usual case, decided without building sets: every member submitted the name with one signature
        # (received signatures are shared, so equal ones are identical) of a kind with no argument to check
        # (the global set's members are every rank: as many entries are all of them).
        if members is not None and len(entries) == len(members) and kind is not Kind.BROADCAST and all(
                [sigs_of[rank][index] is first_sig for rank, index in entries.items()]) and (
                ps_id == 0 or all([rank in entries for rank in members])):
            responses.append(Response(name, first_sig))
            continue
        if members is None:
            responses.append(Response(name, first_sig, error=f"process set {ps_id} is not registered on "
                                      f"every rank", error_kind="process_set"))
            continue
        present = set(entries)
        stand_ins = frozenset(joined - present) if ps_id == 0 else frozenset()
        if not set(members) <= present | stand_ins:
            missing = sorted(set(members) - present - stand_ins)
            age = max(messages[rank].ages[index] for rank, index in entries.items())
            stalled.append(Stalled(name, kind, sorted(present), missing, age, first_sig, (table, messages),
                                   all(index in messages[rank].again for rank, index in entries.items())))
            continue
        sigs = {rank: sigs_of[rank][index] for rank, index in entries.items()}
        error = invalid_argument(name, sigs, members)
        if error is not None:
            responses.append(Response(name, first_sig, error=error + submitted_at(messages, key, present),
                                      error_kind="invalid"))
            continue
        error = describe_mismatch(name, sigs)
        behind = {r for r in entries if error is not None and entries[r] in messages[r].again}  # still in a loop
        if behind and present - behind and not {sigs[r] for r in behind} & {sigs[r] for r in present - behind}:
            responses.append(Response(name, first_sig, f"{error}{submitted_at(messages, key, present)} Ranks "
                                      f"{sorted(present - behind)} left the loop ranks {sorted(behind)} are in: "
                                      f"their {kind} waits for these ranks' next one", "behind", frozenset(behind)))
            continue
        if error is not None:
            error += submitted_at(messages, key, present)
        if error is None and stand_ins and kind not in join_tolerant:
            hint = " (HVDLITE_JOIN_ALLOWS_ALLGATHER_BROADCAST=1 lets it run)" * (kind in JOIN_TOLERANT_PERMISSIVE)
            error = (f"{kind} of {name!r} cannot run while ranks {sorted(stand_ins)} have called join() "
                     f"({str(kind).capitalize()} is not supported with Join at this time){hint}")
        if error is None and kind is Kind.BROADCAST and ps_id == 0 and first_sig.root in stand_ins:
            error = (f"broadcast of {name!r} has root rank {first_sig.root}, which has already "
                     f"called join(); the root must not join before its broadcasts")
        # a joined rank never submitted the name: told of it, it skips past it (the ranks' names stay in step)
        responses.append(Response(name, first_sig, error=error, joined=stand_ins,
                                  error_kind="join" if error is not None and stand_ins else "mismatch"))

    if join is not None and len(joined) == world_size:
        last = max(joined, key=lambda r: (messages[r].join_cycle, r))
        responses.append(Response(*join, last_joined=last))
    return responses, stalled


# -- mismatch text: what differs between the ranks' arguments for one name, arguments no member can use ---------
def invalid_argument(name: str, sigs: dict[int, Signature], members: list[int]) -> Optional[str]:
    """An argument some member passed that cannot work, checked here where every member sees every member's
    arguments: each member fails the op with the same ValueError (none raises alone, none stalls)."""
    first = sigs[min(sigs)]
    if first.kind is Kind.BROADCAST:
        bad = {rank: sig.root for rank, sig in sigs.items() if sig.root not in members}
        if bad:
            return (f"broadcast of {name!r}: root_rank is not a member of the process set ({grouped(bad)}); the set's "
                    f"ranks are {members}. root_rank is a rank of the whole job (as in Horovod), also with "
                    f"process_set=; pass one of the set's ranks")
    return None


def describe_mismatch(name: str, sigs: dict[int, Signature]) -> Optional[str]:
    """None if all ranks agree, else a message naming what differs and on which ranks."""
    if len(set(sigs.values())) == 1:
        return None
    kind = sigs[min(sigs)].kind
    for field, label in FIELD_LABELS.items():
        values = {rank: getattr(sig, field) for rank, sig in sigs.items()}
        if len(set(values.values())) == 1:
            continue
        if field == "tensors":
            label, values = _tensor_difference(kind, values)
        detail = grouped({rank: _show(value) for rank, value in values.items()})
        return (f"Mismatched {kind} for tensor {name!r}: the {label} differs across ranks ({detail}). "
                f"Every rank must submit a name with the same {label}; give different tensors "
                f"different names.")
    return f"Mismatched {kind} for tensor {name!r}: ranks submitted different arguments"


def _tensor_difference(kind: Kind, values: dict[int, tuple[Any, ...]]) -> tuple[str, dict[int, object]]:
    if len({len(v) for v in values.values()}) > 1:
        return "number of tensors", {r: len(v) for r, v in values.items()}
    if len({tuple(t[0] for t in v) for v in values.values()}) > 1:
        return "dtype", {r: _one(tuple(t[0] for t in v)) for r, v in values.items()}
    label = "shape beyond the first dimension" if kind in (Kind.ALLGATHER, Kind.ALLTOALL) else "shape"
    return label, {r: _one(tuple(t[1] for t in v)) for r, v in values.items()}


def _one(values: tuple[Any, ...]) -> object:
    return values[0] if len(values) == 1 else list(values)


def _show(value: object) -> str:
    return str(tuple(value)) if isinstance(value, tuple) and all(isinstance(x, int) for x in value) \
        else str(value)


def pending_flags(pending: dict[tuple[int, str], Request], agrees: Callable[[int], bool], joined: frozenset[int],
                  tolerant: frozenset[Kind]) -> int:
    """FLAG_FULL for requests here without a cache bit but a join (explained when made: engine._cycle); FLAG_EXPLAIN
    too for one whose set is not this engine's, or a global-set one that the ``joined`` ranks cannot stand in for
    (decide's errors say why: a kind join does not tolerate, a broadcast from a joined root)."""
    flags, agrees = 0, functools.cache(agrees)  # (one call per set, not per request: 1,000 unnamed ops a round)
    for req in pending.values():
        kind, ps_id = req.sig.kind, req.sig.ps_id
        if req.cache_bit < 0 and kind is not Kind.JOIN:
            flags |= FLAG_FULL if agrees(ps_id) else FLAG_FULL | FLAG_EXPLAIN
        if joined and ps_id == 0 and kind is not Kind.JOIN and (
                kind not in tolerant or kind is Kind.BROADCAST and req.sig.root in joined):
            flags |= FLAG_EXPLAIN
    return flags


def vote_round(engine: Engine, cached: list[Response]) -> list[Response]:
    """The cached responses, then the new names voted through (docs/ARCHITECTURE.md, step 4): the lowest rank
    proposes its pending names but ``cached``'s; another signature or an unusable argument takes an explaining round."""
    comm, mpi, pending, members_of = engine.comm, engine.mpi_ops, engine.completion.pending, engine.psets.ranks
    mine, joined = b"", engine.completion.joined  # a rank that joined proposes nothing: the lowest other one does
    proposer = next(r for r in range(engine.size) if r not in joined) if joined else engine.scope.proposer
    if engine.rank == proposer:
        skip = {resp.key for resp in cached}
        mine = pickle.dumps(name_table((req.name, req.sig) for key, req in pending.items()
                                       if key not in skip and req.sig.kind is not Kind.JOIN), protocol=5)
    wait = functools.partial(polling.wait, cap=NEGOTIATION_POLL_CAP, arrival=True)
    size = np.array([len(mine)], dtype=np.int64)
    wait(start_allreduce(comm, mpi.tree, np.array(size), size, None, mpi.MPI.MAX, wait))
    engine.vote_bytes += 8
    engine.negotiation_calls += 1
    if not size[0]:  # nothing proposed
        return cached
    buf = np.frombuffer(mine, dtype=np.uint8).copy() if mine else np.empty(int(size[0]), dtype=np.uint8)
    wait(comm.Ibcast(buf, root=engine.scope.local(proposer)))
    names, index, sigs = pickle.loads(buf.tobytes())
    sigs = [shared(sig) for sig in sigs]  # equal signatures are one object: ``is`` decides the usual case
    count, words = len(names), (len(names) + 63) // 64
    bits = np.zeros(2 * 64 * words, dtype=bool)  # the missing bits, then the other-signature bits
    for j, (name, i) in enumerate(zip(names, index)):
        sig = sigs[i]
        if engine.rank in members_of.get(sig.ps_id, ()):  # a non-member has no say
            req = pending.get((sig.ps_id, name))
            if req is None:
                bits[j] = not (sig.ps_id == 0 and engine.rank in joined)  # a rank that joined stands in
            elif req.sig is not sig and req.sig != sig:
                bits[64 * words + j] = True
    vec = np.packbits(bits, bitorder="little").view(np.uint64)
    result = np.empty_like(vec)
    wait(start_allreduce(comm, mpi.tree, vec, result, None, mpi.BOR, wait))
    engine.vote_bytes += int(size[0]) + result.nbytes
    engine.negotiation_calls += 2
    bits = np.unpackbits(result.view(np.uint8), bitorder="little").view(bool)
    if bits[64 * words:64 * words + count].any():
        return explaining_round(engine, False)  # another signature somewhere: the explaining round says which
    responses = []
    for j in np.flatnonzero(~bits[:count]).tolist():
        sig = sigs[index[j]]
        if sig.kind is Kind.BROADCAST and invalid_argument(names[j], {0: sig}, members_of.get(sig.ps_id, [])):
            return explaining_round(engine, False)  # an argument no member can use: explained with the members' lines
        responses.append(Response(names[j], sig))
    remember(engine, responses)
    return cached + responses


def explaining_round(engine: Engine, shutdown: bool) -> list[Response]:
    """Every member's whole message gathered (placed at its job rank) and decided from (``decide``)."""
    engine.explain_cycles += 1
    now = time.monotonic()
    msg = RankMessage(engine.completion.pending.values(), now, shutdown=shutdown, join_cycle=engine.join_cycle,
                      tune=engine.observer.outgoing(), elsewhere=_elsewhere(engine))
    sizes: list[int] = []
    messages = engine.scope.job_ranks(allgather_messages(engine.comm, msg, sizes), RankMessage)
    engine.full_path_bytes += sum(sizes) + 8 * len(sizes)
    engine.negotiation_calls += 2
    stopping = [r for r, m in enumerate(messages) if m.shutdown]
    if stopping:
        raise Stop(shutdown_message(engine.rank, stopping))
    engine.observer.adopt(messages[0].tune, engine.cycles)  # every rank switches here, at the same cycle
    responses, stalled = decide(messages, engine.psets.ranks, len(messages), engine.join_tolerant)
    engine.completion.joined = frozenset(r for r, m in enumerate(messages) if m.join_cycle >= 0)
    engine.watchdog.last_check = now
    if stalled and not engine.config.stall_check_disable:
        failed = engine.watchdog.handle(stalled)
        responses.extend(failed)
        if failed and (engine.parent or engine.set_engines):  # for this rank's other engines' stall notes
            engine.recent_stalls = [(now, r.key) for r in failed if r.key in engine.completion.pending]
    remember(engine, responses)
    return responses


def remember(engine: Engine, responses: list[Response]) -> None:
    """Keep the agreed names in the response cache: a name as itself, a generated one as its stream's next."""
    cache, members = engine.cache, engine.psets.ranks
    last: dict[tuple[int, str], Response] = {}  # each stream's last generated name agreed: its next one is kept
    for resp in responses:
        if resp.error is not None:
            continue
        stream, number = generated(resp.name)
        if number >= 0:  # a generated name stands for one call: never submitted again
            last[(resp.sig.ps_id, stream)] = resp
        else:  # a plain agreement (no stand-ins) is what the cache would make: it keeps it
            plain = resp if not resp.joined and resp.last_joined < 0 else None
            cache.put(resp.name, resp.sig, members.get(resp.sig.ps_id, []), engine.cycles, plain)
    for resp in last.values():
        cache.put_stream(resp.name, resp.sig, members.get(resp.sig.ps_id, []), engine.cycles)


def _elsewhere(engine: Engine) -> list[tuple[int, str]]:
    """(set, name)s in flight in this rank's other engines or failed there lately by a stall verdict (stall notes)."""
    since = time.monotonic() - max(engine.config.stall_shutdown_time_seconds, engine.config.stall_check_time_seconds)
    world = engine.parent or engine
    return [key for other in [world, *world.set_engines.values()] if other is not engine for key in  # list(set):
            [*list(other.completion.inflight), *(key for when, key in other.recent_stalls if when >= since)]]  # atomic
