"""The rounds beyond the bit vector: the vote on new names and the explaining round, run on the engine's behalf."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from . import stalls
from .messages import RankMessage, pending_message
from .negotiation import allgather_messages, decide
from .requests import Response
from .stalls import Stop
from .vote import vote

if TYPE_CHECKING:
    from .loop import Engine

__all__ = ["explaining_round", "remember", "vote_round"]


def vote_round(engine: Engine, cached: list[Response]) -> list[Response]:
    """The cached responses, then the names voted through (vote.py); or the explaining round's."""
    voted = vote(engine.comm, engine.mpi_ops, engine.rank, engine.scope.proposer, engine.psets.ranks,
                 engine.completion.pending, {resp.key for resp in cached}, engine.scope.local)
    engine.vote_bytes += voted.received_bytes
    engine.negotiation_calls += voted.calls
    if voted.responses is None:
        return explaining_round(engine, False)
    engine.full_cycles += 1
    remember(engine, voted.responses)
    return cached + voted.responses


def explaining_round(engine: Engine, shutdown: bool) -> list[Response]:
    """Every member's whole message gathered (placed at its job rank) and decided from (negotiation.decide)."""
    engine.full_cycles += 1
    engine.explain_cycles += 1
    now = time.monotonic()
    msg = pending_message(engine.completion.pending.values(), now, shutdown=shutdown, join_cycle=engine.join_cycle,
                          tune=engine.observer.outgoing(), elsewhere=_elsewhere(engine))
    sizes: list[int] = []
    messages = engine.scope.job_ranks(allgather_messages(engine.comm, msg, sizes), RankMessage)
    engine.full_path_bytes += sum(sizes) + 8 * len(sizes)
    engine.negotiation_calls += 2
    stopping = [r for r, m in enumerate(messages) if m.shutdown]
    if stopping:
        raise Stop(stalls.shutdown_message(engine.rank, stopping))
    engine.observer.adopt(messages[0].tune, engine.cycles)  # every rank switches here, at the same cycle
    responses, stalled = decide(messages, engine.psets.ranks, len(messages), engine.join_tolerant)
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
    cache, members, names = engine.cache, engine.psets.ranks, engine.names
    single_use = names.single_use if names is not None else None
    last: dict[tuple[int, str], Response] = {}  # each stream's last generated name agreed: its next one is kept
    for resp in responses:
        if resp.error is not None:
            continue
        if single_use is not None and single_use(resp.name):  # never submitted again
            last[(resp.sig.ps_id, resp.name.rpartition(".noname.")[0])] = resp
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
