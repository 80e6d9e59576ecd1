"""Every custom forward/backward of moezoo, one file per op: Triton kernel (where there is one) +
launcher -> ``torch.library.custom_op`` / ``autograd.Function`` -> used by a layer. Each has a
pure-torch reference with the same signature; without triton (or on CPU tensors) the references run
(kernels.launch decides).

One entry per file, ``kernels/<file>.py``: its ops, what they do -> where they are used.

- ``moe_permute``: ``moe_permute`` / ``moe_unpermute``, tokens -> expert-sorted rows and back ->
  layers.moe.experts
- ``moe_combine``: ``moe_combine``, the weighted sum of each token's expert rows ->
  layers.moe.experts
- ``moe_swiglu``: ``swiglu``, ``scale * silu(a) * b``, fwd + bwd -> layers.moe.experts
- ``moe_gate_up``: ``gate_up``, permute fused into the SwiGLU gate/up grouped GEMMs' backward ->
  layers.moe.experts
- ``grouped_wgrad``: ``grouped_linear`` / ``grouped_wgrad``, bf16 grouped linear; weight gradients
  split along the rows for small experts -> layers.moe.experts, moe_gate_up
- ``moe_fp8``: ``fp8_grouped_linear`` + ``fp8_quantize_*``, rowwise-scaled e4m3 grouped GEMMs,
  fwd + dgrad + wgrad -> layers.moe.experts, moe_gate_up
- ``router_matmul``: ``router_matmul``, bf16 inputs, float32 logits -> layers.moe.layer
- ``adamw``: ``adamw_``, AdamW over float32 masters writing the bf16 weights, one launch per
  group -> training.optim
- ``semi_sparse_linear``: ``SemiSparseLinear``, 2:4 sparse linear (cuSPARSELt) ->
  layers.dst.semi_structured
- ``launch``: ``jit`` / ``use_triton`` / ``HAVE_TRITON``, launch helpers -> the Triton ops above
"""

from moezoo import _checkout_path

__path__ = _checkout_path(__path__, "kernels")
