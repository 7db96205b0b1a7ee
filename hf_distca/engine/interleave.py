"""Nano-batches as coroutines: several forwards through the same model, one at a time, switching inside
the ``distca`` attention function (layer-level ping-pong).

:func:`run_interleaved` runs each callable (one nano-batch's forward) on its own thread, but only one
runs at any moment: a baton passes from one to the next when the running one calls :func:`switch`
(the engine calls it right after starting an exchange, see :mod:`.layer_op`) or returns. So while one
nano-batch's all-to-all is in flight, the other runs its projections, MLP, norms and its own kernels.
Threads rather than generators or greenlets because the forwards go through unmodified Transformers
code, and because PyTorch keeps per-thread state that each nano-batch needs for itself (the saved-tensor
hooks of activation checkpointing, the rematerialization frames of :mod:`hf_distca.engine.remat`).

Determinism: the order of turns depends only on the program (round robin in the callables' order, a
turn ends at a switch or a return), never on timing, so every rank issues its collectives in the same
order. Each thread starts with the caller's grad mode, autocast settings, CUDA device and stream.

The first round: a nano-batch's first engine call prepares (the consistency check of its new layout and
the comparison of its new plan: all-gathers whose results the host reads) and then passes the turn
until every live nano-batch has prepared its own first call (:meth:`Interleave.first_call_prepared`);
only then does the first of them start its dispatch. So no host read of a check waits behind another
nano-batch's exchange, and the exchanges still start in the nano-batches' order (A's dispatch first).
The price: the other nano-batches' first projections run before A's first dispatch instead of behind it.

The chain: every engine node created under an interleave takes the previous node's chain token (a
zero-size tensor that requires grad) and returns the next, across nano-batches, so autograd runs the
nodes' backward in exactly the reverse of their creation order (autograd's own ordering uses per-thread
sequence numbers, which say nothing across threads); the same order on every rank, and each nano-batch's
backward exchanges fly while the other nano-batch's layer backward runs.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Interleave", "attention_done", "current", "run_interleaved", "switch"]

_local = threading.local()


class _Aborted(Exception):
    """Raised in a nano-batch's thread when another one failed: it unwinds without running on."""


class Interleave:
    """The baton and the chain token shared by the nano-batches of one interleaved forward."""

    def __init__(self, count: int, after_attention: Callable[[Any], None] | None = None) -> None:
        self.after_attention = after_attention
        """Called with the attention module each time a nano-batch's attention call returns (it switched
        twice inside): what the other nano-batch's turns may have undone, e.g. a parameter-sharding
        wrapper that resharded the layer this one is still inside, is redone there."""
        self._cond = threading.Condition()
        self._turn = 0
        self._live = [True] * count
        self._failed = False
        self._chain: torch.Tensor | None = None
        self._prepared = [False] * count

    # ------------------------------------------------------------------ the baton
    def _next_live(self, index: int) -> int | None:
        n = len(self._live)
        for step in range(1, n + 1):
            j = (index + step) % n
            if self._live[j]:
                return j
        return None

    def _wait_turn(self, index: int) -> None:
        self._cond.wait_for(lambda: self._turn == index or self._failed)
        if self._failed:
            raise _Aborted

    def switch(self, index: int) -> None:
        """End nano-batch ``index``'s turn: the next live one runs until it switches or returns."""
        with self._cond:
            nxt = self._next_live(index)
            if nxt is None or nxt == index:
                return
            self._turn = nxt
            self._cond.notify_all()
            self._wait_turn(index)

    def first_call_prepared(self, index: int) -> None:
        """Nano-batch ``index`` has prepared its first engine call (see the module docstring): pass the turn
        until every live nano-batch has prepared its own, so that the checks' host reads all happen before
        the first exchange starts. A later call returns at once."""
        if self._prepared[index]:
            return
        self._prepared[index] = True
        # at least one switch: a later nano-batch completing the round lets the earlier ones dispatch first
        self.switch(index)
        while not all(done or not live for done, live in zip(self._prepared, self._live)):
            self.switch(index)

    def _finish(self, index: int, failed: bool) -> None:
        with self._cond:
            self._live[index] = False
            self._failed = self._failed or failed
            nxt = self._next_live(index)
            if nxt is not None:
                self._turn = nxt
            self._cond.notify_all()

    # ------------------------------------------------------------------ the chain
    def chain_token(self, like: torch.Tensor) -> torch.Tensor:
        """The token the next engine node takes (the first one: a fresh zero-size leaf on ``like``'s device)."""
        if self._chain is None:
            self._chain = torch.zeros(0, device=like.device, requires_grad=True)
        return self._chain

    def set_chain_token(self, token: torch.Tensor) -> None:
        self._chain = token


def current() -> tuple[Interleave, int] | None:
    """The interleave and the nano-batch index of the calling thread; None outside an interleaved forward."""
    inter = getattr(_local, "interleave", None)
    return None if inter is None else (inter, _local.index)


def switch() -> None:
    """Hand the turn to the next nano-batch (no-op outside an interleaved forward)."""
    here = current()
    if here is not None:
        here[0].switch(here[1])


def attention_done(module: Any) -> None:
    """The attention function's call for ``module`` returned (see :attr:`Interleave.after_attention`)."""
    here = current()
    if here is not None and here[0].after_attention is not None:
        here[0].after_attention(module)


def _thread_state() -> Callable[[], Any]:
    """A function that, called in another thread, enters the caller's grad mode, autocast settings and
    CUDA device and stream; returns the context to exit."""
    grad = torch.is_grad_enabled()
    autocasts = [
        (dev, torch.get_autocast_dtype(dev)) for dev in ("cuda", "cpu") if torch.is_autocast_enabled(dev)
    ]
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    device = torch.cuda.current_device() if cuda else None
    stream = torch.cuda.current_stream() if cuda else None

    def enter() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch.set_grad_enabled(grad))
        for dev, dtype in autocasts:
            stack.enter_context(torch.autocast(dev, dtype=dtype))
        if device is not None:
            torch.cuda.set_device(device)
            stack.enter_context(torch.cuda.stream(stream))
        return stack

    return enter


def run_interleaved(
    fns: Sequence[Callable[[], Any]], after_attention: Callable[[Any], None] | None = None
) -> list[Any]:
    """Run ``fns`` as coroutines (see the module docstring) and return their results in order. The first
    exception raised by any of them is re-raised here once all have stopped. One callable runs inline.
    ``after_attention``: see :attr:`Interleave.after_attention`."""
    if len(fns) == 1:
        return [fns[0]()]
    if current() is not None:
        raise RuntimeError("run_interleaved cannot nest: a nano-batch's forward started another interleave")
    inter = Interleave(len(fns), after_attention)
    results: list[Any] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)
    enter = _thread_state()

    # no failure of its own that one rank alone meets: the order of turns is the program's, so an error
    # every rank raises together (the engine's checks) stops the same nano-batch at the same point on
    # every rank, and the others abort at their next switch, the same one everywhere; an error of one
    # rank alone (e.g. out of memory) is that rank's, as without an interleave
    def body(index: int) -> None:
        _local.interleave, _local.index = inter, index
        failed = False
        try:
            with inter._cond:
                inter._wait_turn(index)
            with enter():
                results[index] = fns[index]()
        except _Aborted:
            failed = True
        except BaseException as exc:  # re-raised by the caller
            errors[index], failed = exc, True
        finally:
            _local.interleave = None
            inter._finish(index, failed)

    threads = [threading.Thread(target=body, args=(i,), name=f"distca-nano-{i}") for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for exc in errors:
        if exc is not None:
            raise exc
    return results
