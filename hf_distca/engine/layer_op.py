"""Core attention of one nano-batch inside an interleaved forward (layer-level ping-pong).

The operator of :mod:`.op` runs a whole attention call inside one autograd node. Here the call is cut at
its two exchanges into three nodes, and the turn passes to the other nano-batch (:mod:`.interleave`)
after each cut, so that an exchange flies while the other nano-batch computes:

forward                                           backward (reverse order, the chain enforces it)
1. ``_Dispatch``: start the dispatch; switch      3'. wait for the gradients' return, gather dq, dk, dv
2. ``_Serve``: wait for it, run the server        2'. wait for the backward dispatch, run the backward
   kernel, start the return; switch                   kernel, start the gradients' return
3. ``_Return``: wait for it, gather the output    1'. start the backward dispatch (q, out, dout, k, v)

So in forward nano-batch A's dispatch flies while B runs its projections (and its own dispatch starts),
A's return while B's kernel runs, and B's return while A runs its MLP and the next layer's projections;
backward mirrors it. Same stages, same bytes, same results as :func:`hf_distca.engine.core_attention`
with one part (the micro-batch is split into nano-batches by the data path, not here).

The three nodes share one :class:`_Call` (the plan, the exchanges in flight, the server's log-sum-exp).
Only ``_Return`` saves tensors (q, k, v, out, as the operator of :mod:`.op` does), so activation
checkpointing's recompute and rematerialization-aware checkpointing (:mod:`hf_distca.engine.remat`: the
replay saves the same four) work unchanged. Gradients of q, k, v leave through ``_Dispatch``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hf_distca.comm import Chain, Exchange
from hf_distca.engine import stages
from hf_distca.engine.interleave import Interleave
from hf_distca.engine.prepare import PreparedAttention
from hf_distca.engine.remat import keep_for_recompute
from hf_distca.engine.stages import GradReturn, stage_range
from hf_distca.kernels import ForwardTensors


@dataclass
class _Call:
    """One attention call of one nano-batch, shared by its three nodes."""

    prep: PreparedAttention
    runner: Any
    """The same call's one-part runner (:class:`~hf_distca.engine.op.PingPongRunner`): its group and
    kernel, and what a rematerialization-aware replay records."""
    kv_dtype: torch.dtype
    index: int
    """The nano-batch's index: its stages' profiler ranges are ``distca.<pass>.<stage>.<index>``."""
    in_flight: Exchange | Chain | None = None
    """The exchange (or chain of them, with the KV relay) started by the last node that ran (forward or
    backward)."""
    out_kernel: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    backward_inputs: tuple | None = None
    """(q, k, v, out, dout) from the backward dispatch to the backward kernel."""
    grads: GradReturn | None = None

    def wait(self) -> torch.Tensor | list[torch.Tensor] | None:
        """What the exchange in flight received (a chain: every stage's buffer), once it has."""
        exchange, self.in_flight = self.in_flight, None
        return None if exchange is None else exchange.wait()


def _next(token: torch.Tensor) -> torch.Tensor:
    return token.new_empty(0)  # the next link of the chain (zero-size; autograd links it to this node)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, token, call: _Call):  # type: ignore[override]
        with stage_range(f"fwd.dispatch.{call.index}"):
            call.in_flight = stages.dispatch(call.prep, q, k, v, call.runner.group, async_op=True)
        ctx.call = call
        return _next(token)

    @staticmethod
    def backward(ctx, dtoken):  # type: ignore[override]
        call = ctx.call
        with stage_range(f"bwd.wait_return.{call.index}"):
            dq, dk, dv = stages.gather_grads(call.prep, call.grads, call.kv_dtype)
        call.grads = None
        return dq, dk, dv, dtoken, None


class _Serve(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, token, call: _Call, sinks):  # type: ignore[override]
        run = call.runner
        with stage_range(f"fwd.wait_dispatch.{call.index}"):
            received = call.wait()
        with stage_range(f"fwd.compute.{call.index}"):
            # (Tk, Hq, D), (Tk, Hq)
            call.out_kernel, call.lse = stages.compute(call.prep, q, k, v, received, run.kernel, sinks)
        del received  # the received rows are freed once the kernel has run
        with stage_range(f"fwd.return.{call.index}"):
            call.in_flight = stages.return_outputs(call.prep, call.out_kernel, run.group, async_op=True)
        ctx.call, ctx.sinks = call, sinks  # the sinks (a leaf parameter) as an attribute, like op.py's
        return _next(token)

    @staticmethod
    def backward(ctx, dtoken):  # type: ignore[override]
        call, run = ctx.call, ctx.call.runner
        q, k, v, out, dout = call.backward_inputs
        call.backward_inputs = None
        with stage_range(f"bwd.wait_dispatch.{call.index}"):
            received = call.wait()
        with stage_range(f"bwd.compute.{call.index}"):
            # dq (Tk, Hq, D), dk and dv (Tkv, Hkv, D); this server's share of the sinks' gradient
            fwd = ForwardTensors(q, k, v, out, call.lse)
            *grads, dsinks = stages.compute_backward(call.prep, fwd, dout, received, run.kernel, ctx.sinks)
        del received
        with stage_range(f"bwd.return.{call.index}"):
            call.grads = stages.return_grads(call.prep, *grads, run.group, async_op=True)
        return None, None, None, dtoken, None, dsinks


class _Return(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, token, call: _Call):  # type: ignore[override]
        with stage_range(f"fwd.wait_return.{call.index}"):
            returned = call.wait()
        out = stages.gather_outputs(call.prep, call.out_kernel, returned)  # (T_local, Hq, D)
        call.out_kernel = None
        keep_for_recompute(out, call.lse, call.runner)
        ctx.save_for_backward(q, k, v, out)
        ctx.call = call
        return out, _next(token)

    @staticmethod
    def backward(ctx, dout, dtoken):  # type: ignore[override]
        call = ctx.call
        q, k, v, out = ctx.saved_tensors
        dout = dout.contiguous()
        call.backward_inputs = (q, k, v, out, dout)
        with stage_range(f"bwd.dispatch.{call.index}"):
            call.in_flight = stages.dispatch_backward(
                call.prep, q, k, v, out, dout, call.runner.group, async_op=True
            )
        return None, None, None, dtoken, None


def interleaved_core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prep: PreparedAttention,
    inter: Interleave,
    index: int,
    *,
    runner: Any,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Balanced core attention of nano-batch ``index`` of ``inter``: the three nodes, with a switch to the
    other nano-batch after the first two. q: (T_local, Hq, D); k, v: (T_local, Hkv, D); returns
    (T_local, Hq, D), differentiable w.r.t. q, k, v (and the attention ``sinks``, (Hq,), when given).
    ``runner``: the call's one-part runner (its group and kernel)."""
    call = _Call(prep, runner, k.dtype, index)
    token = _Dispatch.apply(q, k, v, inter.chain_token(q), call)
    inter.set_chain_token(token)
    inter.switch(index)
    token = _Serve.apply(q, k, v, inter.chain_token(q), call, sinks)
    inter.set_chain_token(token)
    inter.switch(index)
    out, token = _Return.apply(q, k, v, inter.chain_token(q), call)
    inter.set_chain_token(token)
    return out
