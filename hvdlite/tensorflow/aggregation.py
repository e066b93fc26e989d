"""Local gradient aggregation (``backward_passes_per_step``), shared by every DistributedOptimizer.

``aggregate`` adds one backward pass' gradients to this rank's sums and, on every N-th pass, returns the sums
reduced over the ranks (the other passes: the sums so far); ``on_reduced_pass`` then runs the real update only
on the pass that reduced. Both are built from ``tf.cond`` on a counter variable, so they work eagerly, in a
``tf.function`` and in a ``tf.compat.v1`` graph; after the reducing pass the counter is 0 again.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from .mpi_ops import dense

__all__ = ["new_state_variable", "aggregate", "on_reduced_pass"]


def new_state_variable(initial: Any, name: str) -> tf.Variable:
    """A non-trainable variable made outside any function or cond branch being built; in a ``tf.compat.v1``
    graph a local variable (initialised by ``local_variables_initializer`` or a MonitoredTrainingSession,
    never checkpointed)."""
    with tf.init_scope():
        if tf.executing_eagerly():
            return tf.Variable(initial, trainable=False, name=name)
        return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _after(dependencies: Sequence[Any], make: Callable[[], Any]) -> Any:
    """``make()``, built after ``dependencies`` (eagerly everything already runs in program order)."""
    with tf.control_dependencies([d for d in dependencies if d is not None]):
        return make()


def aggregate(grads: Sequence[Any], accumulators: Sequence[Optional[tf.Variable]], counter: tf.Variable,
              steps: int, average: bool, reduce: Callable[[list[Any], list[int]], list[Any]]) -> list[Any]:
    """Add ``grads`` (None entries stay None; sparse ones are made dense) to ``accumulators`` (one per
    gradient, zeroed when ``counter`` is 0) and count the pass. On the ``steps``-th pass return
    ``reduce(sums, positions)`` of the sums (divided by ``steps`` if ``average``) and set ``counter`` to 0;
    otherwise return the sums."""
    present = [i for i, g in enumerate(grads) if g is not None]
    accs: list[tf.Variable] = [accumulators[i] for i in present]

    def clear() -> tf.Tensor:
        return _after([a.assign(tf.zeros_like(a), read_value=False) for a in accs], lambda: tf.constant(0))

    cleared = tf.cond(tf.equal(counter.read_value(), 0), clear, lambda: tf.constant(0))
    added = _after([cleared], lambda: [a.assign_add(tf.cast(dense(grads[i]), a.dtype), read_value=False)
                                       for i, a in zip(present, accs)])
    counted = _after(added, lambda: counter.assign_add(tf.cast(1, counter.dtype), read_value=False))
    passes = _after([counted], counter.read_value)

    def reduce_sums() -> list[tf.Tensor]:
        sums: list[Any] = [a.read_value() for a in accs]
        if average:
            sums = [g / tf.cast(steps, g.dtype) for g in sums]
        reduced = [dense(r) for r in reduce(sums, present)]
        reset = _after(reduced, lambda: counter.assign(tf.zeros_like(counter), read_value=False))
        return _after([reset], lambda: [tf.identity(r) for r in reduced])

    def keep_sums() -> list[tf.Tensor]:
        return [a.read_value() for a in accs]

    outs = tf.nest.flatten(tf.cond(passes >= tf.cast(steps, counter.dtype), reduce_sums, keep_sums))
    result: list[Any] = [None] * len(grads)
    for i, out in zip(present, outs):
        result[i] = out
    return result


def on_reduced_pass(counter: tf.Variable, grads: Sequence[Any], apply: Callable[[], Any],
                    skip: Callable[[], Any]) -> tf.Tensor:
    """``apply()`` if the pass that produced ``grads`` (from :func:`aggregate`) reduced, else ``skip()``;
    returns a bool tensor (True: applied). The counter is read after ``grads`` were computed."""
    just_reduced = _after([dense(g) for g in grads if g is not None],
                          lambda: tf.equal(counter.read_value(), tf.zeros_like(counter)))
    return tf.cond(just_reduced, lambda: _after(_ops(apply()), lambda: tf.constant(True)),
                   lambda: _after(_ops(skip()), lambda: tf.constant(False)))


def _ops(result: Any) -> list[Any]:
    """What a graph must run for ``result`` (an update's return value) to have happened."""
    return [result] if isinstance(result, (tf.Operation, tf.Tensor)) else []
