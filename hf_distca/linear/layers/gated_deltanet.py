"""Gated DeltaNet layers of Transformers hybrids on sequence-parallel linear attention (the shared part).

Transformers' gated DeltaNet modules (Qwen3-Next, OLMo-hybrid) share one computation per token: project
the hidden state to q, k (``num_k_heads`` heads of ``head_k_dim``), v (``num_v_heads`` heads of
``head_v_dim``), an output gate and a, b (one per value head); run a causal depthwise convolution
(``conv_kernel_size`` taps, then the ``activation``) over the concatenated q|k|v rows; L2-normalise q and
k (eps 1e-6 inside the square root), share each q/k head among ``num_v_heads / num_k_heads`` consecutive
value heads, and run the gated delta rule per value head in float32::

    S_t = (I - beta_t k_t k_t^T) exp(g_t) S_{t-1} + beta_t k_t v_t^T,   o_t = S_t^T q_t / sqrt(K)

with g = -exp(A_log) softplus(a + dt_bias); then a gated RMS norm with the gate and the output projection.
They differ in how the projections are laid out, in beta (sigmoid(b), doubled by OLMo-hybrid's
``allow_neg_eigval``) and in the names of the norm and output projection: :class:`GatedDeltaNetSP` runs the
shared part and its subclasses (``qwen3_next.py``, ``olmo_hybrid.py``) say the rest.

The replacement restarts both the convolution and the recurrence at every document start (documents from
``cu_seq_lens``, else from the position ids that :func:`pass_position_ids` hands it, else one per row), i.e.
it equals the Transformers module run on each document alone (tests). With a ``distca_layout`` kwarg
documents continue across ranks: the convolution through a halo exchange of the last K - 1
pre-convolution rows (:mod:`hf_distca.linear.ops.conv_halo`), the recurrence through the dense-transition
state scan (:func:`hf_distca.linear.ops.linear_attention`). It keeps the very same parameter objects
under the same names (``state_dict`` and ``save_pretrained`` unchanged).
"""

from __future__ import annotations

import abc
import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN

from hf_distca.linear.config import LinearSPConfig
from hf_distca.linear.layers.rows import cu_seqlens_of, input_pieces
from hf_distca.linear.ops.conv_halo import causal_conv_pieces
from hf_distca.linear.ops.local import prepare_backend, recurrence, resolve_linear_backend
from hf_distca.linear.ops.sequence_parallel import linear_attention

__all__ = ["POSITION_IDS_KWARG", "GatedDeltaNetSP", "pass_position_ids"]

POSITION_IDS_KWARG = "distca_position_ids"
"""The kwarg that carries the decoder layer's ``position_ids`` to the replaced layer (see ``pass_position_ids``)."""

_SIZES = (
    "num_k_heads",
    "num_v_heads",
    "head_k_dim",
    "head_v_dim",
    "key_dim",
    "value_dim",
    "conv_kernel_size",
)
_L2NORM_EPS = 1e-6  # Transformers' (and flash-linear-attention's) l2norm: x / sqrt(sum(x^2) + eps)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + _L2NORM_EPS)


def _copy_position_ids(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    if kwargs.get("position_ids") is not None:
        kwargs = {**kwargs, POSITION_IDS_KWARG: kwargs["position_ids"]}
    return args, kwargs


def pass_position_ids(decoder_layer: nn.Module):
    """Let the gated DeltaNet inside ``decoder_layer`` see the packed row's ``position_ids``.

    The decoder layers of Qwen3-Next and OLMo-hybrid consume ``position_ids`` and pass their other kwargs
    on to their linear-attention layer; a forward pre-hook copies them into those kwargs as
    ``distca_position_ids``, so rows packed with position ids only (no ``cu_seq_lens``) restart at every
    document like the softmax layers. Returns the hook handle."""
    return decoder_layer.register_forward_pre_hook(_copy_position_ids, with_kwargs=True)


class GatedDeltaNetSP(nn.Module, abc.ABC):
    """Drop-in replacement of one Transformers gated DeltaNet instance (same submodules and parameters).

    Subclasses name the submodules they read (``uses``) and define :meth:`project`, :meth:`beta`,
    :meth:`gated_norm` and :meth:`output`."""

    uses: tuple[str, ...] = ()
    """Submodules and parameters of the Transformers module that the subclass reads."""

    linear_kind = "delta"
    """The transition of its recurrence (an fla kind, see ``hf_distca.linear.ops.fla_backend.fla_kind``)."""

    def __init__(self, original: nn.Module, *, group=None, config: LinearSPConfig | None = None):
        super().__init__()
        # the original's submodules and parameters, same objects, same names, same order (same state_dict)
        for name, child in original.named_children():
            self.add_module(name, child)
        for name, param in original.named_parameters(recurse=False):
            self.register_parameter(name, param)
        missing = [
            n
            for n in (
                *self.uses,
                "conv1d",
                "A_log",
                "dt_bias",
                *_SIZES,
                "activation",
                "layer_idx",
                "hidden_size",
            )
            if not hasattr(original, n)
        ]
        if missing:
            raise ValueError(
                f"{type(original).__name__} lacks {missing}; this Transformers version's gated DeltaNet is not "
                f"the one {type(self).__name__} was written for"
            )
        for name in (*_SIZES, "activation", "layer_idx", "hidden_size"):
            setattr(self, name, getattr(original, name))
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of linear_num_key_heads "
                f"({self.num_k_heads})"
            )
        if self.conv1d.bias is not None and tuple(self.conv1d.bias.shape) != (self.conv1d.out_channels,):
            raise ValueError(f"conv1d bias shaped {tuple(self.conv1d.bias.shape)} is not per channel")
        self.layer_type = getattr(original, "layer_type", "linear_attention")
        self.linear_sp_group = group
        self.linear_sp_config = config if config is not None else LinearSPConfig()
        # the local backend of its CUDA forwards, chosen now: an explicit 'fla' that cannot run raises here
        self.linear_sp_backend = prepare_backend(self.linear_sp_config.backend, self.linear_kind)

    @abc.abstractmethod
    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """hidden (N, hidden) -> q|k|v before the convolution (N, 2 key_dim + value_dim), the output gate
        (N, Hv, Dv), b and a (N, Hv)."""

    def beta(self, b: torch.Tensor) -> torch.Tensor:
        """The delta rule's per-token write strength from b (N, Hv)."""
        return b.sigmoid()

    @abc.abstractmethod
    def gated_norm(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """(N Hv, Dv) core output and gate -> the normed, gated (N Hv, Dv)."""

    @abc.abstractmethod
    def output(self, core: torch.Tensor) -> torch.Tensor:
        """(B, S, value_dim) -> (B, S, hidden)."""

    def forward(
        self,
        hidden_states: torch.Tensor,
        cache=None,
        attention_mask: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """hidden_states (B, S, hidden) -> (B, S, hidden), as the Transformers module."""
        if cache is not None or kwargs.get("cache_params") is not None:
            raise ValueError(
                f"{type(self).__name__} keeps no decoding cache: run training forwards with use_cache=False "
                "(model.config.use_cache = False); generate with the original Transformers module"
            )
        batch, seq, _ = hidden_states.shape
        mask = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        if mask is not None:  # padding rows project to zero and add nothing to the conv or the state
            hidden_states = (hidden_states * mask[:, :, None]).to(hidden_states.dtype)
        # documents from the layout, cu_seq_lens, the position ids pass_position_ids hands over, or rows
        pieces, all_pieces = input_pieces(
            batch, seq, mask=mask, kwargs=kwargs, position_ids=kwargs.get(POSITION_IDS_KWARG)
        )
        group = self.linear_sp_group if all_pieces is not None else None  # None: no communication

        flat = hidden_states.reshape(batch * seq, -1)  # (N, hidden): rows flattened, one packed stream
        mixed, gate, b, a = self.project(flat)  # (N, conv_dim), (N, Hv, Dv), (N, Hv), (N, Hv)
        n = flat.shape[0]
        weight = self.conv1d.weight.squeeze(1)  # (conv_dim, K)
        mixed = causal_conv_pieces(
            mixed, weight, self.conv1d.bias, pieces, all_pieces=all_pieces, group=group
        )
        mixed = ACT2FN[self.activation](mixed).to(hidden_states.dtype)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)

        # the recurrence in at least float32 (Transformers' kernels compute it in float32); fla takes the
        # model's dtype and accumulates in float32 inside
        state_dtype = torch.promote_types(hidden_states.dtype, torch.float32)
        if hidden_states.is_cuda:
            backend = self.linear_sp_backend
        else:
            backend = resolve_linear_backend(
                self.linear_sp_config.backend, hidden_states.device, kind=self.linear_kind
            )
        kernel_dtype = hidden_states.dtype if backend == "fla" else state_dtype
        repeat = self.num_v_heads // self.num_k_heads
        q = _l2norm(q.reshape(n, self.num_k_heads, self.head_k_dim).to(state_dtype))  # (N, Hk, Dk)
        k = _l2norm(k.reshape(n, self.num_k_heads, self.head_k_dim).to(state_dtype))
        q, k = (x.repeat_interleave(repeat, dim=1).to(kernel_dtype) for x in (q, k))  # (N, Hv, Dk)
        v = v.reshape(n, self.num_v_heads, self.head_v_dim).to(kernel_dtype)  # (N, Hv, Dv)
        beta = self.beta(b).to(kernel_dtype)  # (N, Hv)
        log_decay = -self.A_log.to(state_dtype).exp() * F.softplus(
            a.to(state_dtype) + self.dt_bias
        )  # (N, Hv)
        scale = self.head_k_dim**-0.5
        if all_pieces is not None:
            core = linear_attention(
                q,
                k,
                v,
                pieces,
                log_decay=log_decay,
                beta=beta,
                scale=scale,
                group=group,
                all_pieces=all_pieces,
                config=dataclasses.replace(self.linear_sp_config, backend=backend),
            )  # (N, Hv, Dv)
        else:
            core, _ = recurrence(
                q,
                k,
                v,
                cu_seqlens=cu_seqlens_of(pieces),
                log_decay=log_decay,
                beta=beta,
                scale=scale,
                backend=backend,
            )
        core = core.to(hidden_states.dtype)
        core = self.gated_norm(
            core.reshape(-1, self.head_v_dim), gate.reshape(-1, self.head_v_dim)
        )  # (N Hv, Dv)
        return self.output(core.reshape(batch, seq, self.value_dim))
