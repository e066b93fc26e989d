"""Every DistributedOptimizer's gradient combination (TF1, Keras 3, tf-keras): :class:`Combiner`, with the local
aggregation of ``backward_passes_per_step`` (``tf.cond`` on a counter: eagerly, in tf.function and in a graph)."""
from __future__ import annotations

from functools import partial
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from .mpi_ops import dense
from .reduction import reduce_gradients

__all__ = ["Combiner", "aggregate", "on_reduced_pass"]


class Combiner:
    """One optimizer's gradient combination: its settings, the variables whose gradients stay local, and the
    ``backward_passes_per_step`` sums and counter (``counter``: Horovod's ``_agg_helper.counter``)."""

    def __init__(self, settings: dict, graph_locals: bool) -> None:
        self.settings = settings
        self.graph_locals = graph_locals  # in a tf.compat.v1 graph, the state is made of local variables
        self.local_vars: set = set()
        self.accumulators: dict = {}
        self.counter: Optional[tf.Variable] = None
        self.prepared: list = []  # tf-keras: the gradients _compute_gradients reduced, until applied

    def reduce(self, grads: list[Any], variables: list[Any], generic_names: bool = False) -> list[Any]:
        """``grads`` (of ``variables``) reduced, local ones divided by the set size if ``scale_local_gradients``;
        named after the variables, or with ``generic_names`` after their positions."""
        s = self.settings
        local = [id(v) in self.local_vars for v in variables]
        shared = [v for v, is_local in zip(variables, local) if not is_local]
        names = [str(getattr(v, "path", None) or getattr(v, "name", None) or f"source.{i}") if not generic_names
                 else f"source.{i}" for i, v in enumerate(shared)]
        reduced = iter(reduce_gradients([g for g, is_local in zip(grads, local) if not is_local], s["compression"],
                                        s["sparse_as_dense"], s["op"], s["gradient_predivide_factor"],
                                        s["process_set"], names))
        size = s["process_set"].size()
        out = []
        for g, is_local in zip(grads, local):
            if not is_local:
                out.append(next(reduced))
            elif g is not None and s["scale_local_gradients"] and size > 1:
                out.append(tf.IndexedSlices(g.values / size, g.indices, g.dense_shape)
                           if isinstance(g, tf.IndexedSlices) else g / size)
            else:
                out.append(g)
        return out

    def combine(self, grads: list[Any], variables: list[Any]) -> list[Any]:
        """``grads`` reduced; with ``backward_passes_per_step=N``, :func:`aggregate`'d (reduced every N-th call)."""
        s = self.settings
        if s["backward_passes_per_step"] == 1:
            return self.reduce(grads, variables)
        if self.counter is None:
            self.counter = _state_variable(partial(tf.constant, 0, tf.int64), "hvdlite_backward_passes",
                                           self.graph_locals)
        for v, g in zip(variables, grads):
            if g is not None and id(v) not in self.accumulators:
                self.accumulators[id(v)] = _state_variable(partial(tf.zeros, v.shape, tf.as_dtype(v.dtype).base_dtype),
                                                           "hvdlite_gradient_accumulator", self.graph_locals)
        return aggregate(grads, [self.accumulators.get(id(v)) for v in variables], self.counter,
                         s["backward_passes_per_step"], s["average_aggregated_gradients"],
                         lambda sums, at: self.reduce(sums, [variables[i] for i in at]))

    def apply(self, grads: list[Any], variables: list[Any], apply: Callable[[list[Any], list[Any]], Any],
              skip: Callable[[], Any]) -> Any:
        """``apply(combined gradients, variables)``; with N > 1 only on every N-th call, ``skip()`` on the others."""
        combined = self.combine(grads, variables)
        return self.on_reduced(combined, lambda: apply(combined, variables), skip)

    def on_reduced(self, combined: list[Any], apply: Callable[[], Any], skip: Callable[[], Any]) -> Any:
        """``apply()``, or with N > 1 :func:`on_reduced_pass` of gradients ``combine()`` returned."""
        if self.counter is None:  # backward_passes_per_step == 1, or nothing combined yet
            return apply()
        return on_reduced_pass(self.counter, combined, apply, skip)


def _state_variable(make: Callable[[], Any], name: str, graph_local: bool) -> tf.Variable:
    """A non-trainable variable of value ``make()``, made outside any function being built (in a tf.compat.v1
    graph with ``graph_local``: a local variable, never checkpointed)."""
    with tf.init_scope():
        initial = make()
        if tf.executing_eagerly() or not graph_local:
            return tf.Variable(initial, trainable=False, name=name)
        return tf.compat.v1.Variable(initial, trainable=False, name=name, use_resource=True,
                                     collections=[tf.compat.v1.GraphKeys.LOCAL_VARIABLES])


def _after(dependencies: Sequence[Any], make: Callable[[], Any]) -> Any:
    """``make()``, built after ``dependencies`` (eagerly everything already runs in program order)."""
    with tf.control_dependencies([d for d in dependencies if d is not None]):
        return make()


def aggregate(grads: Sequence[Any], accumulators: Sequence[Optional[tf.Variable]], counter: tf.Variable,
              steps: int, average: bool, reduce: Callable[[list[Any], list[int]], list[Any]]) -> list[Any]:
    """Add ``grads`` to ``accumulators`` (zeroed when ``counter`` is 0) and count the pass; on the ``steps``-th
    pass return ``reduce(sums, positions)`` (of the means if ``average``) and reset ``counter``, else the sums."""
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

    outs = dict(zip(present, tf.nest.flatten(tf.cond(passes >= tf.cast(steps, counter.dtype), reduce_sums,
                                                     lambda: [a.read_value() for a in accs]))))
    return [outs.get(i) for i in range(len(grads))]


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
