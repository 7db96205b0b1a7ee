"""The core-attention engine: per-document causal attention of a packed micro-batch, balanced across ranks.

Stages, each callable on its own (an overlap schedule can interleave them):

- probe (:mod:`.probes`), once before the first call: the link and kernel-cost probes the config asks
  for (collective; :func:`hf_distca.enable_distca` runs it);
- prepare (:mod:`.prepare`): plan + this rank's index tensors, cached per micro-batch, checked across
  ranks (:mod:`.consistency`); with ``DistCAConfig.prefetch_plans`` the plan of the next micro-batch is
  made ahead in a background process (:mod:`.prefetch`);
- forward (:mod:`.stages`): dispatch (query rows and KV-prefix rows to their servers, one all-to-all-v),
  compute (one fused server kernel: output and log-sum-exp), return_outputs / gather_outputs;
- backward: dispatch_backward (q, output, output gradient and KV rows re-sent), compute_backward (the
  server's backward kernel), return_grads / gather_grads (dq to query owners, dk/dv to KV owners, summed
  over every task that read them).

:func:`core_attention` chains them in one autograd operator (:mod:`.op`, which also says what is kept
where and the bytes per layer); with ``DistCAConfig.ping_pong`` it runs them on ping-pong
parts (:mod:`.ping_pong`) whose exchanges overlap the other parts' kernels. Under an interleaved forward of
several nano-batches of the data path (:mod:`.interleave`, ``DistCAConfig.layer_ping_pong``) each call is
cut at its exchanges into three chained autograd nodes instead (:mod:`.layer_op`), so that its exchanges
fly while the other nano-batch runs its layers, forward and backward. :func:`local_attention` is the same operator
on one process's own sequences. What the engine remembers between calls (plans, checked layouts, probe
results, the compiled ops' registry, the prefetch worker) is one :class:`EngineState` (:mod:`.state`)
with one reset. Both take part in rematerialization-aware checkpointing (:mod:`hf_distca.engine.remat`).
"""

from hf_distca.engine.consistency import InconsistentInputError
from hf_distca.engine.op import LocalRunner, PingPongRunner, core_attention, local_attention
from hf_distca.engine.ping_pong import PartSplit, ping_pong_parts, whole
from hf_distca.engine.prepare import PreparedAttention, prepare
from hf_distca.engine.probes import probe
from hf_distca.engine.stages import (
    GradReturn,
    Kernel,
    compute,
    compute_backward,
    dispatch,
    dispatch_backward,
    gather_grads,
    gather_outputs,
    return_grads,
    return_outputs,
)
from hf_distca.engine.state import EngineState, engine_state

__all__ = [
    "EngineState",
    "GradReturn",
    "InconsistentInputError",
    "Kernel",
    "LocalRunner",
    "PartSplit",
    "PingPongRunner",
    "PreparedAttention",
    "compute",
    "compute_backward",
    "core_attention",
    "dispatch",
    "dispatch_backward",
    "engine_state",
    "gather_grads",
    "gather_outputs",
    "local_attention",
    "ping_pong_parts",
    "prepare",
    "probe",
    "return_grads",
    "return_outputs",
    "whole",
]
