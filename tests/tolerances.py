"""The one table of test tolerances. Every comparison in the suite takes its tolerance from here.

(rtol, atol) pairs are for torch.testing.assert_close unless the comment says otherwise.
"""

TOL = {
    # ---- pure data movement
    # the engine vs the same kernel on the same rows in one process; save/reload; 1 vs 2 processes when
    # nothing moves: bit-identical
    "exact": (0.0, 0.0),
    # float64 sums over tasks in another order (dk/dv gathered from several servers)
    "fp64_reordered": (1e-12, 1e-12),
    # ---- kernels (inputs standard normal, D <= 32)
    # float64 kernel vs float64 naive oracle: only the operation order differs (logsumexp vs softmax)
    "kernel_fp64": (1e-12, 1e-12),
    # hand-computed closed form (uniform attention = mean of the visible values), float64
    "closed_form": (1e-14, 1e-14),
    # ---- engine vs the single-process oracle (O(1) values, D <= 16, documents <= ~600 tokens)
    # float64 engine vs float64 oracle (different op order, softmax by logsumexp vs max-shift)
    "fp64": (1e-10, 1e-10),
    # float32 vs the float64 oracle on the same float32 inputs: ~1e-5 relative, absolute floor 1e-5 for
    # entries near zero (gradients of O(1) tensors); also float32 kernels vs the naive oracle
    "fp32": (1e-5, 1e-5),
    # ---- linear attention (hf_distca.linear; O(1) inputs, unit-norm keys for the delta rule, <= 200 tokens)
    # float64 scan across pieces vs the per-token float64 oracle on uncut documents: the piece transition
    # is exp(sum of log decays) instead of a product of exps, and states are summed in another order
    "linear_fp64": (1e-10, 1e-10),
    # a float64 Qwen3-Next cut across ranks vs the same replaced model on whole documents in one process:
    # its RMS norms (and gated RMS norms) compute in float32 even in a float64 model, so float64 rounding
    # differences upstream flip a float32 rounding now and then. Loss: relative (measured <= 2.3e-10 on 2
    # and 4 ranks); parameter gradients: rtol and an absolute floor of this x max |reference| (measured
    # max |diff| 2.6e-7 x max |reference|, on entries large enough for the rtol)
    "fp32_norms_loss": (1e-9, 0.0),
    "fp32_norms_grads": (1e-6, 1e-6),
    # ---- Transformers models (tiny fp32 models, initializer_range 0.2, documents <= 300 tokens)
    # distca vs SDPA per document, logits: same math, different kernels and summation order
    "logits": (1e-5, 1e-5),
    # parameter gradients (sums over hundreds of tokens): rtol 1e-4, and an absolute floor of 1e-5 x the
    # largest |entry| of that reference gradient; fp32 noise measured ~1e-6 x max
    "grads": (1e-4, 1e-5),
    # ---- training runs (recipes on several processes, fp32, same global batches)
    # per-step loss, relative; and final weights, absolute, after 3 SGD steps (weights are O(0.1))
    "train_loss": (1e-5, 0.0),
    "train_weights": (0.0, 1e-5),
    # final weights after 2 AdamW steps at lr 1e-3: its first steps normalise each gradient entry
    # (m / sqrt(v) ~ +-1), so rounding differences in entries near eps move a weight by up to lr x O(1e-2);
    # measured max 7.6e-6 (ZeRO-3 with offload on 2 processes vs 1)
    "train_weights_adamw": (0.0, 2e-5),
    # ---- GPU (bf16 inputs; reference in float32/float64)
    # attention output, O(1) entries; measured max ~8e-3 on H200
    "gpu_out": (2e-2, 2e-2),
    # dq/dk/dv: rtol 2e-2 and an absolute floor of 2e-2 x the largest |entry| of the reference gradient;
    # measured max |diff| / max |ref| ~6e-3 for torch_varlen on H200
    "gpu_grad": (2e-2, 2e-2),
    # flash-linear-attention chunk kernels (float32 inputs, tf32/bf16 tensor-core dots inside) vs the float64
    # per-token reference: max |a - b| / max |b| per tensor (outputs, final states, gradients)
    "gpu_linear": (2e-2, 0.0),
    # the chunked PyTorch backend in float32 on CUDA vs the float64 per-token reference, same metric and
    # shapes: float32 rounding only (no tensor-core dots); measured <= 1.1e-6 on CPU at these shapes
    "gpu_linear_chunked": (1e-4, 0.0),
    # log-sum-exp (float32 inside every backend); measured ~3e-6 on H200
    "gpu_lse": (1e-4, 1e-4),
    # engine over NCCL vs the float64 oracle: max |a - b| <= rtol x max |b| per tensor
    "gpu_engine": (2e-2, 0.0),
    # ---- planner
    # balance: loads are exact integer sums in float64; 1e-9 only absorbs the division
    "balance": (1e-9, 0.0),
    # the priced critical path (seconds) recomputed independently: the same float64 byte counts, divided
    # by the bandwidth instead of multiplied by its inverse, summed in another order
    "critical_path": (1e-12, 0.0),
    # planning time of one step (1,000 long-tailed documents over 64 servers), median of 5, seconds
    "plan_seconds": (0.050, None),
}
