"""megablocks dMoE (Gale et al. 2023, grouped-GEMM path) as a compute backend of layers.MoE.

The dMoE is built once per MoE module and called through ``torch.func.functional_call`` with the
MoE's own tensors, so both backends share one set of weights and gradients reach ``gate`` and
``experts.w*``. megablocks routes by itself (softmax in the activation dtype, top-k, p=1
renormalised: the Mixtral router), so only that configuration maps onto it. Weight mapping
(research/moe.md §3.3): ``router.layer.weight = gate.weight``, ``experts.mlp.w1 = w1.reshape(E*H,
D)``, ``experts.mlp.v1 = w3.reshape(E*H, D)``, ``experts.mlp.w2 = w2.transpose(1, 2).reshape(E*H,
D)``. CUDA + bfloat16 only (grouped_gemm); imported only when this backend is chosen.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from moezoo.configs import MoEConfig
from moezoo.configs.errors import check


def check_megablocks_config(cfg: MoEConfig, key: str) -> None:
    check(
        cfg.router == "softmax"
        and cfg.norm_topk
        and cfg.capacity_factor is None
        and cfg.bias_update_rate == 0,
        f"{key}.backend",
        "megablocks dMoE maps only the dropless softmax router with renormalised top-k",
    )


def build_dmoe(dim: int, hidden_dim: int, num_experts: int, top_k: int, device) -> torch.nn.Module:
    """A bf16 megablocks dMoE with the Mixtral router and SwiGLU experts (grouped-GEMM path)."""
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE

    args = Arguments(
        hidden_size=dim,
        ffn_hidden_size=hidden_dim,
        num_layers=1,
        bias=False,
        return_bias=False,
        activation_fn=F.silu,
        moe_num_experts=num_experts,
        moe_top_k=top_k,
        moe_normalize_expert_weights=1,
        mlp_type="glu",
        mlp_impl="grouped",
        fp16=False,
        bf16=True,
        device=device,
    )
    return dMoE(args)


def megablocks_params(moe) -> dict:
    """The MoE's tensors under megablocks' parameter names (views/reshapes keep the autograd
    link)."""
    E, H, D = moe.experts.w1.shape
    return {
        "router.layer.weight": moe.gate.weight,
        "experts.mlp.w1": moe.experts.w1.reshape(E * H, D),
        "experts.mlp.v1": moe.experts.w3.reshape(E * H, D),
        "experts.mlp.w2": moe.experts.w2.transpose(1, 2).reshape(E * H, D),
    }


def megablocks_forward(moe, x: torch.Tensor) -> torch.Tensor:
    """x [T, D] -> routed-expert output [T, D] computed by megablocks with ``moe``'s weights."""
    from megablocks.layers.moe import clear_load_balancing_loss

    if getattr(moe, "_dmoe", None) is None:
        # Stored outside the module tree so its own (unused) parameters never reach the optimizer.
        object.__setattr__(
            moe, "_dmoe", build_dmoe(moe.dim, moe.hidden_dim, moe.num_experts, moe.top_k, x.device)
        )
    dmoe = moe._dmoe
    dmoe.train(moe.training)
    params = {k: v.to(x.dtype) for k, v in megablocks_params(moe).items()}
    out = torch.func.functional_call(dmoe, params, (x.unsqueeze(1),))
    clear_load_balancing_loss()  # megablocks keeps per-layer loss tensors in a module global
    return out.squeeze(1)
