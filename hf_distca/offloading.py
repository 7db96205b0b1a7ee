"""Activation offload for a checkpointed Transformers model: what checkpointing keeps, in host memory.

With activation checkpointing each decoder layer keeps its input from forward to backward, and
rematerialization-aware checkpointing (:mod:`hf_distca.checkpointing`) also its attention output and
log-sum-exp. :func:`offload_activations` moves them off the device, through public interfaces only:

- a forward pre-hook and a forward hook (``always_call=True``) on every decoder layer. Transformers (>= 5.25)
  checkpoints a layer's ``forward``, not its ``__call__``, so the hooks run outside the checkpoint, and
  torch's non-reentrant checkpoint saves the checkpointed function's tensor inputs under whatever
  ``saved_tensors_hooks`` are active there: the hooks make them the :class:`~hf_distca.engine.offload.Offloader`'s
  (side-stream copies into the host arena, brought back a layer ahead). Inside the checkpoint torch's own
  hooks take over, so nothing else of the layer is offloaded. A layer that does not checkpoint (e.g.
  ``every_n_layers``) is left alone.
- the same hooks tell the layer's rematerialization frame where to keep the attention results
  (:class:`~hf_distca.engine.remat.KeptPlacement`): per layer ``"gpu"``, ``"host"`` or ``"drop"``
  (:mod:`hf_distca.kept_attention`).

Turn checkpointing on first (``hf_distca.enable_remat_checkpointing``, or Transformers' own, non-reentrant),
then call :func:`offload_activations`; :class:`hf_distca.DistCACallback` does both with ``offload=``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch.autograd.graph import saved_tensors_hooks

from hf_distca import kept_attention as kept
from hf_distca.checkpointing import checkpointing_enabled
from hf_distca.engine.host_arena import HostArena
from hf_distca.engine.offload import Offloader
from hf_distca.engine.remat import KeptPlacement, placing_kept_attention
from hf_distca.offload_timing import LayerTimer, weigh_host_against_drop

__all__ = [
    "OFFLOAD_ATTR",
    "ActivationOffload",
    "OffloadOptions",
    "check_offload_applies",
    "choose_offloaded_inputs",
    "decoder_layers",
    "local_numel",
    "offload_activations",
    "pins_host_memory",
    "resolve_over_ranks",
]

OFFLOAD_ATTR = "distca_offload"
"""The attribute of a model that holds its :class:`ActivationOffload` (its one owner)."""


@dataclass(frozen=True)
class OffloadOptions:
    """What :func:`offload_activations` moves off the device, and how."""

    inputs: bool = False
    """Keep each checkpointed decoder layer's input in host memory (copied on a side stream, brought back a
    layer ahead in backward). On a CUDA device only as many layers as ``host_fraction`` of the available host
    memory holds (the first ones; the last layers keep theirs on the device), chosen for micro-batches of
    ``tokens_per_rank`` rows before the first step by :class:`hf_distca.DistCACallback`
    (:meth:`ActivationOffload.resolve`), else from the first layer call's rows (:func:`choose_offloaded_inputs`)."""
    kept_attention: str | tuple[str, ...] = "gpu"
    """Where rematerialization-aware checkpointing keeps each layer's attention output and log-sum-exp:
    "gpu", "host", "drop" (recomputed in backward), one per layer, or "auto" (chosen before the first step from
    free memory, :func:`hf_distca.kept_attention.choose_kept_attention`; host layers weighed against dropping
    after it, :mod:`hf_distca.offload_timing`)."""
    min_bytes: int = 1 << 20
    """Tensors smaller than this stay where they are."""
    chunk_bytes: int = 1 << 30
    """Size of the host arena's chunks (a larger tensor gets a chunk of its own size)."""
    device_fraction: float = 0.5
    """``kept_attention="auto"``: the share of free device memory the kept outputs may take."""
    host_fraction: float = 0.8
    """The share of available host memory (divided among the node's ranks, ``LOCAL_WORLD_SIZE``) that
    offloaded layer inputs and, with ``kept_attention="auto"``, kept outputs may take."""
    working_set_layers: float = 14.0
    """``kept_attention="auto"``: the device memory one layer's recompute and backward (and the loss) take at
    the peak, in multiples of one layer's checkpointed input, reserved before the kept outputs get their
    share of free device memory. The default is an estimate for Llama-style layers with the tiled MLP and
    norms (the attention's q, k, v, output and their gradients, the norms' outputs, the residual stream
    and its gradient, the inputs brought back); the recipe's ``--memory-snapshot`` measures it."""

    def __post_init__(self) -> None:
        if not isinstance(self.inputs, bool):
            raise ValueError(f"OffloadOptions.inputs must be True or False, got {self.inputs!r}")
        if not isinstance(self.kept_attention, str):
            object.__setattr__(self, "kept_attention", tuple(self.kept_attention))  # frozen: hashable
        layers = 1 if isinstance(self.kept_attention, str) else len(self.kept_attention)
        kept.per_layer(self.kept_attention, layers)
        if not isinstance(self.working_set_layers, int | float) or self.working_set_layers < 0:
            raise ValueError(
                f"OffloadOptions.working_set_layers must be a number >= 0, got {self.working_set_layers!r}"
            )
        for name in ("device_fraction", "host_fraction"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0.0 < value <= 1.0):
                raise ValueError(f"OffloadOptions.{name} must be in (0, 1], got {value!r}")
        if not isinstance(self.min_bytes, int) or self.min_bytes < 0:
            raise ValueError(f"OffloadOptions.min_bytes must be an int >= 0, got {self.min_bytes!r}")

    @property
    def active(self) -> bool:
        """Whether these options change anything (else nothing needs installing)."""
        return self.inputs or self.kept_attention != "gpu"

    @property
    def needs_remat(self) -> bool:
        """Whether they act on kept attention outputs (rematerialization-aware checkpointing only)."""
        return self.kept_attention != "gpu" and (
            isinstance(self.kept_attention, str) or any(c != "gpu" for c in self.kept_attention)
        )


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's decoder layers in order: its Transformers ``GradientCheckpointingLayer`` modules."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def local_numel(tensor: torch.Tensor) -> int:
    """Elements this rank holds of ``tensor``: its local shard under FSDP2 (a DTensor's ``numel`` is the
    global size) and ZeRO-3 (a partitioned parameter has ``numel`` 0; its shard is ``ds_tensor``)."""
    shard = getattr(tensor, "ds_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard.numel()
    to_local = getattr(tensor, "to_local", None)  # torch.distributed.tensor.DTensor
    return to_local().numel() if callable(to_local) else tensor.numel()


def choose_offloaded_inputs(
    layers: int, input_bytes: int, *, free_host: int | None, host_fraction: float = 0.8
) -> list[bool]:
    """Which decoder layers keep their checkpointed input in host memory, one flag per layer: the FIRST
    layers, as many as ``host_fraction x free_host`` holds (backward needs the last layers' inputs first, so
    those stay on the device and the copies back have the most time to hide). ``free_host`` None (no CUDA
    device: the copies are plain host memory anyway, e.g. the CPU tests): every layer."""
    if free_host is None or input_bytes <= 0:
        return [True] * layers
    on_host = min(layers, int(host_fraction * free_host // input_bytes))
    return [True] * on_host + [False] * (layers - on_host)


def pins_host_memory(device: torch.device) -> bool:
    """Whether offloaded copies of activations on ``device`` go to page-locked host memory: on a CUDA device
    (asynchronous copies), not on the CPU (plain host memory, nothing to copy asynchronously)."""
    return device.type == "cuda"


def _local_ranks() -> int:
    """Ranks sharing this node's host memory (torchrun / accelerate set LOCAL_WORLD_SIZE)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


class ActivationOffload:
    """The offload installed on one model: hooks, offloader, host arena and the kept-attention policy."""

    def __init__(self, model: torch.nn.Module, options: OffloadOptions) -> None:
        self.options = options
        self.layers = decoder_layers(model)
        self._params = list(model.parameters())
        if not self.layers:
            raise ValueError(
                f"offload_activations: {type(model).__name__} has no Transformers decoder layers "
                "(GradientCheckpointingLayer modules) to offload around"
            )
        self.policy = kept.per_layer(options.kept_attention, len(self.layers))
        # per layer: its checkpointed input goes to host memory (None: chosen at the first step)
        self.inputs_policy: list[bool] | None = None if options.inputs else [False] * len(self.layers)
        embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        weight = getattr(embeddings, "weight", None)
        # the residual stream between layers (what checkpointing keeps) has the embeddings' dtype, also
        # under autocast
        self.input_dtype = weight.dtype if weight is not None else next(model.parameters()).dtype
        self.input_layer_bytes = 0  # one layer's checkpointed input at the first step
        self.kept_layer_bytes = 0  # one layer's kept attention output and log-sum-exp at the first step
        self.timer: LayerTimer | None = (
            None  # the step being timed for weigh(), between start_timing and weigh
        )
        config = getattr(model, "config", None)
        self._heads = getattr(config, "num_attention_heads", None)
        self._hidden = getattr(config, "hidden_size", 0) or 0
        self._head_dim = getattr(config, "head_dim", None) or self._hidden // max(self._heads or 1, 1)
        # unpinned until the first checkpointed call shows where activations are (_place_arena)
        self.offloader = Offloader(HostArena(options.chunk_bytes), min_bytes=options.min_bytes)
        self._arena_placed = False
        self._first_call = threading.Lock()  # the nano-batch threads' first calls
        self.choice: dict[str, Any] = {}
        self._local = threading.local()  # the layer calls entered on this thread (nano-batch threads)
        self._handles = []
        for index, layer in enumerate(self.layers):
            self._handles.append(layer.register_forward_pre_hook(self._enter_hook(index), with_kwargs=True))
            self._handles.append(layer.register_forward_hook(self._exit_hook(index), always_call=True))

    # -------------------------------------------------------------------------------- the policy
    def resolve(
        self, tokens: int, dtype: torch.dtype, *, free_device: int | None, free_host: int
    ) -> list[str]:
        """Choose which layers' inputs go to host memory (``inputs=True``) and ``kept_attention="auto"``'s
        per-layer policy, for micro-batches of ``tokens`` rows per rank (``dtype``: the attention's) from the
        free memory given (the callback gives the least over the ranks; ``free_device`` None: no CUDA device);
        the node's ranks share ``free_host``. A fixed policy is kept. Returns the kept-attention policy."""
        layers = len(self.layers)
        host_share = free_host // _local_ranks()
        self.input_layer_bytes = (
            tokens * self._hidden * torch.empty((), dtype=self.input_dtype).element_size()
        )
        if self.inputs_policy is None:
            self.inputs_policy = choose_offloaded_inputs(
                layers, self.input_layer_bytes, free_host=None if free_device is None else host_share,
                host_fraction=self.options.host_fraction,
            )  # fmt: skip
            self.choice["offload_inputs_free_host_gib"] = host_share / 2**30
        if self.policy is None:
            if free_device is not None:  # what backward allocates later is not free for kept outputs
                gradients = self.gradients_to_come()
                working_set = int(self.options.working_set_layers * self.input_layer_bytes)
                free_device = max(0, free_device - gradients - working_set)
                self.choice["kept_attention_gradients_reserved_gib"] = gradients / 2**30
                self.choice["kept_attention_working_set_reserved_gib"] = working_set / 2**30
            kept_bytes = kept.kept_attention_bytes(tokens, self._heads or 0, self._head_dim, dtype)
            self.kept_layer_bytes = kept_bytes
            on_host = sum(self.inputs_policy) * self.input_layer_bytes
            self.policy = kept.choose_kept_attention(
                layers, kept_bytes, free_device=free_device, free_host=host_share,
                inputs_on_device=layers * self.input_layer_bytes - on_host, inputs_on_host=on_host,
                device_fraction=self.options.device_fraction, host_fraction=self.options.host_fraction,
            )  # fmt: skip
            self.choice.update(
                kept_attention_free_device_gib=None if free_device is None else free_device / 2**30,
                kept_attention_free_host_gib=host_share / 2**30,
                kept_attention_layer_gib=kept_bytes / 2**30,
            )
        return self.policy

    def start_timing(self, device: torch.device) -> bool:
        """Time the next step's decoder layer and core attention forwards (CUDA events) for :meth:`weigh`,
        where there is something to weigh: ``kept_attention="auto"`` that put layers' outputs in host memory,
        on a CUDA device. Returns whether it times."""
        auto = self.options.kept_attention == "auto"
        if not (auto and self.policy is not None and "host" in self.policy and device.type == "cuda"):
            return False
        self.timer = LayerTimer(len(self.layers))
        return True

    def weigh(
        self,
        attention_s: list[float | None],
        layer_s: list[float | None],
        seconds_per_byte: tuple[float, float],
    ) -> list[str]:
        """``kept_attention="auto"``'s second look from measured figures (every rank the same ones:
        :func:`hf_distca.offload_timing.weigh_over_ranks`): a layer whose outputs are in host memory drops
        them where their copies (``seconds_per_byte`` out and back) would cost more than recomputing its
        attention (:func:`hf_distca.offload_timing.weigh_host_against_drop`). Returns the new policy."""
        out_rate, back_rate = seconds_per_byte
        kept_copy = (self.kept_layer_bytes * out_rate, self.kept_layer_bytes * back_rate)
        inputs = self.input_layer_bytes
        other = [(inputs * out_rate, inputs * back_rate) if on else (0.0, 0.0) for on in self.inputs_policy]
        before = list(self.policy)
        self.policy = weigh_host_against_drop(before, attention_s, layer_s, kept_copy, other)
        measured = [a for a in attention_s if a is not None]
        layers = [t for t in layer_s if t is not None]
        self.choice.update(
            kept_attention_weighed_to_drop=sum(a != b for a, b in zip(before, self.policy, strict=True)),
            kept_attention_attention_s=sum(measured) / len(measured) if measured else None,
            kept_attention_layer_s=sum(layers) / len(layers) if layers else None,
            kept_attention_copy_s=list(kept_copy),
        )
        return self.policy

    def gradients_to_come(self) -> int:
        """Bytes of the gradients that backward will allocate on the device and that do not exist yet:
        parameters that require one, have none, and are not in host memory (FSDP2's CPU offload keeps
        parameters and their gradients there); a sharded parameter counts its local shard."""
        return sum(
            local_numel(p) * p.element_size()
            for p in self._params
            if p.requires_grad and p.grad is None and p.device.type != "cpu"
        )

    def _place_arena(self, hidden_states: torch.Tensor) -> None:
        """Page-lock the host arena where the activations are on a CUDA device (:func:`pins_host_memory`),
        whatever device the parameters are on (FSDP2's CPU offload keeps them in host memory)."""
        if pins_host_memory(hidden_states.device) and not self.offloader.arena.pin:
            self.offloader.arena = HostArena(self.options.chunk_bytes, pin=True)  # nothing offloaded yet
        self._arena_placed = True

    def _resolve_at_first_call(self, hidden_states: torch.Tensor) -> None:
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        if (
            world > 1 and self.policy is None
        ):  # the inputs' split may differ between ranks: no math depends on it
            raise RuntimeError(
                "offload_activations(kept_attention='auto') on several ranks: every rank must keep the same "
                "layers' outputs, so the choice is made before the first step from the least free memory over "
                "the ranks: call ActivationOffload.resolve(...) first (DistCACallback does), or give a fixed "
                "kept_attention ('gpu', 'host', 'drop' or one per layer)"
            )
        tokens = hidden_states.numel() // hidden_states.shape[-1]
        where = hidden_states.device.type
        # attention runs in autocast's dtype where autocast is on (the residual stream stays in its own)
        dtype = torch.get_autocast_dtype(where) if torch.is_autocast_enabled(where) else hidden_states.dtype
        self.resolve(
            tokens, dtype,
            free_device=kept.free_device_bytes(hidden_states.device), free_host=kept.free_host_bytes(),
        )  # fmt: skip

    # --------------------------------------------------------------------------------- the hooks
    def _calls(self) -> list:
        if not hasattr(self._local, "calls"):
            self._local.calls = []
        return self._local.calls

    def _enter_hook(self, index: int):
        def enter(layer: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            calls = self._calls()
            calls.append(None)  # until placed below: what the exit hook pops, also after a refusal here
            if not (layer.gradient_checkpointing and layer.training and torch.is_grad_enabled()):
                return  # this call keeps its activations itself: nothing to place
            hidden_states = args[0] if args else kwargs.get("hidden_states")
            if not isinstance(hidden_states, torch.Tensor):
                raise TypeError(
                    f"offload_activations: decoder layer {index} ({type(layer).__name__}) was called without "
                    "hidden_states (first positional argument or keyword `hidden_states`), so its input's size and "
                    "device are unknown; call the layer with its hidden states, or leave out inputs / kept_attention "
                    "(OffloadOptions, --offload-activations / --kept-attention)"
                )
            if not self._arena_placed or self.policy is None or self.inputs_policy is None:
                with self._first_call:
                    if not self._arena_placed:
                        self._place_arena(hidden_states)
                    if self.policy is None or self.inputs_policy is None:
                        self._resolve_at_first_call(hidden_states)
            if self.inputs_policy[index] and not args:
                raise ValueError(
                    f"OffloadOptions(inputs=True) (--offload-activations): decoder layer {index} "
                    f"({type(layer).__name__}) got hidden_states as a keyword, and Transformers' checkpoint "
                    "keeps keyword arguments in a closure on the device, out of reach of the offload; pass "
                    "hidden_states positionally (as Transformers' models do) or leave inputs off"
                )
            group = self.offloader.begin_group()
            pack = self.offloader.packer(group)
            choice = self.policy[index]
            timer = self.timer
            if timer is not None:
                timer.start_layer(index, threading.get_ident())
            placement = KeptPlacement(
                drop=choice == "drop",
                pack=pack if choice == "host" else None,
                unpack=self.offloader.unpack if choice == "host" else None,
                timings=None if timer is None else timer.attention_events[index],
            )
            contexts = [placing_kept_attention(placement)]
            if self.inputs_policy[index]:
                contexts.append(saved_tensors_hooks(pack, self.offloader.unpack))
            for context in contexts:
                context.__enter__()
            calls[-1] = (group, choice, placement, contexts)

        return enter

    def _exit_hook(self, index: int):
        def exit_(layer: torch.nn.Module, args: tuple, output: Any) -> None:
            call = self._calls().pop()
            if call is None:
                return
            group, choice, placement, contexts = call
            for context in reversed(contexts):
                context.__exit__(None, None, None)
            if self.timer is not None:
                self.timer.end_layer(index, threading.get_ident())
            hidden = output[0] if isinstance(output, (tuple, list)) else output
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad:
                # this layer's backward begins when its output's gradient arrives: bring back the nearest
                # earlier offloaded group then, also when this layer itself offloaded nothing
                hidden.register_hook(self._prefetch_hook(group))
            if choice != "gpu" and not placement.consulted:
                raise RuntimeError(
                    f"kept_attention={choice!r} for decoder layer {index}, but its checkpoint is not "
                    "rematerialization-aware (plain recompute, use_reentrant=True, or a context_fn of your own), "
                    "so there is no attention output to place. Turn it on with hf_distca.enable_remat_checkpointing"
                    " (DistCACallback: leave recompute_attention off), or use kept_attention='gpu'"
                )

        return exit_

    def _prefetch_hook(self, group: int):
        def prefetch(grad: torch.Tensor) -> None:  # returns None: the gradient passes unchanged
            self.offloader.prefetch_before(group)

        return prefetch

    # ------------------------------------------------------------------------------------ report
    def report(self) -> dict[str, Any]:
        """The policy chosen (per layer and counted), what was offloaded, and the host arena's size."""
        out: dict[str, Any] = {"offload_inputs": self.options.inputs}
        if self.inputs_policy is not None:
            out["offload_inputs_host_layers"] = sum(self.inputs_policy)
            out["offload_inputs_layer_gib"] = self.input_layer_bytes / 2**30
        if self.policy is not None:
            out["kept_attention"] = list(self.policy)
            out.update(kept.describe(self.policy))
        out.update(self.choice)
        out.update(self.offloader.report())
        return out

    def remove(self) -> None:
        """Take the hooks off the model (what is offloaded now comes back when backward needs it)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def offload_activations(
    model: torch.nn.Module, options: OffloadOptions | None = None, **fields: Any
) -> ActivationOffload:
    """Keep what the model's activation checkpointing keeps off the device, as ``options`` (or the
    :class:`OffloadOptions` ``fields``) say. Checkpointing must be on (non-reentrant; for ``kept_attention``
    other than "gpu" rematerialization-aware: :func:`hf_distca.enable_remat_checkpointing`). Replaces an
    earlier call's offload on the same model. Returns the installed :class:`ActivationOffload` (also
    ``getattr(model, OFFLOAD_ATTR)``): its ``report()`` says what was chosen and moved."""
    if options is not None and fields:
        raise ValueError("offload_activations: pass OffloadOptions or its fields, not both")
    options = options or OffloadOptions(**fields)
    if not checkpointing_enabled(model):
        raise ValueError(
            "offload_activations moves what activation checkpointing keeps, and checkpointing is off: turn it on "
            "first (hf_distca.enable_remat_checkpointing(model), or --gradient-checkpointing in the recipes)"
        )
    previous = getattr(model, OFFLOAD_ATTR, None)
    if previous is not None:
        previous.remove()
    offload = ActivationOffload(model, options)
    setattr(model, OFFLOAD_ATTR, offload)
    return offload


def check_offload_applies(
    options: OffloadOptions | None, *, attn_implementation: str | None, checkpointing: bool, remat: bool
) -> None:
    """Refuse offload options a Trainer run would not honour (every rank alike, before training): any of
    them without activation checkpointing, and a kept-attention placement other than "gpu" where no
    attention output is kept (attention other than ``distca``, or checkpointing that recomputes it:
    ``recompute_attention``/``--recompute-attention`` or ``use_reentrant=True``)."""
    if options is None or not options.active:
        return
    if not checkpointing:
        raise ValueError(
            f"OffloadOptions(inputs={options.inputs!r}, kept_attention={options.kept_attention!r}) "
            "(--offload-activations, --kept-attention): no effect without activation checkpointing, which is what "
            "they move off the device; add --gradient-checkpointing (TrainingArguments(activation_checkpointing="
            "True)) or leave them out"
        )
    if options.needs_remat and (attn_implementation != "distca" or not remat):
        where = (
            f"attn_implementation={attn_implementation!r}"
            if attn_implementation != "distca"
            else "checkpointing that recomputes attention (recompute_attention / --recompute-attention, or "
            "use_reentrant=True)"
        )
        raise ValueError(
            f"kept_attention={options.kept_attention!r} (--kept-attention): no effect under {where}, which keeps no "
            "attention output; only rematerialization-aware checkpointing of distca attention does (--attn distca "
            "or local, without --recompute-attention). Leave it at 'gpu'"
        )


def resolve_over_ranks(
    offload: ActivationOffload, tokens: int, dtype: torch.dtype, device: torch.device, group: Any = None
) -> list[str]:
    """Choose ``kept_attention="auto"`` before the first step from the least free device and host memory
    over the ranks of ``group`` (one all-gather; every rank gets the same policy)."""
    from hf_distca.comm import all_gather_rows

    free_device = kept.free_device_bytes(device)
    rows = all_gather_rows([-1 if free_device is None else free_device, kept.free_host_bytes()], group)
    least_device = min(r[0] for r in rows)
    return offload.resolve(
        tokens,
        dtype,
        free_device=None if least_device < 0 else least_device,
        free_host=min(r[1] for r in rows),
    )
