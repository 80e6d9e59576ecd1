"""Every custom forward/backward of moezoo, one file per op: Triton kernel (where there is one) +
launcher -> ``torch.library.custom_op`` / ``autograd.Function`` -> used by a layer. Each has a
pure-torch reference with the same signature; without triton (or on CPU tensors) the references run
(kernels.launch decides).

| op | file | used by |
| --- | --- | --- |
| ``moe_permute`` / ``moe_unpermute`` (tokens -> expert-sorted rows and back) | moe_permute | layers.moe.experts |
| ``moe_combine`` (weighted sum of each token's expert rows) | moe_combine | layers.moe.experts |
| ``swiglu`` (``scale * silu(a) * b``, fwd + bwd) | moe_swiglu | layers.moe.experts |
| ``gate_up`` (permute fused into the SwiGLU gate/up grouped GEMMs' backward) | moe_gate_up | layers.moe.experts |
| ``grouped_linear`` / ``grouped_wgrad`` (bf16 grouped linear; weight gradients split along the rows for small experts) | grouped_wgrad | layers.moe.experts, moe_gate_up |
| ``fp8_grouped_linear`` + ``fp8_quantize_*`` (rowwise-scaled e4m3 grouped GEMMs, fwd + dgrad + wgrad) | moe_fp8 | layers.moe.experts, moe_gate_up |
| ``router_matmul`` (bf16 inputs, float32 logits) | router_matmul | layers.moe.layer |
| ``adamw_`` (AdamW over float32 masters, writing the bf16 weights; one launch per group) | adamw | training.optim |
| ``SemiSparseLinear`` (2:4 sparse linear, cuSPARSELt) | semi_sparse_linear | layers.dst.semi_structured |
| ``jit`` / ``use_triton`` / ``HAVE_TRITON`` (launch helpers) | launch | the Triton ops above |
"""

from moezoo import _checkout_path

__path__ = _checkout_path(__path__, "kernels")
