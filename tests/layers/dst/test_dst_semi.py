"""2:4 DST layers through torch's semi-structured kernels: same forward and gradients as the masked
dense linear (GPU), and a clean dense-masked fallback where no kernel exists (CPU)."""

import pytest
import torch
from torch import nn

from moezoo.layers import DynamicSparsity


class Stack(nn.Module):
    def __init__(self, dims):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(i, o, bias=False) for o, i in dims)

    def forward(self, x):
        for lin in self.layers:
            x = lin(x)
        return x


def _grads(model, x):
    model.zero_grad()
    with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=x.is_cuda):
        y = model(x)
    y.float().square().mean().backward()
    return y.float(), [lin.weight.grad.clone() for lin in model.layers]


def test_semi_structured_falls_back_to_masked_dense_on_cpu():
    torch.manual_seed(0)
    model = Stack([(128, 128)])
    with pytest.warns(UserWarning, match="stay dense-masked"):
        dst = DynamicSparsity(
            model, None, sparsity=0.5, granularity="nm", semi_structured=True, total_steps=10
        )
    assert dst.semi_structured == [] and "forward" not in vars(model.layers[0])


@pytest.mark.gpu
@pytest.mark.parametrize("transposable", [False, True])
def test_semi_structured_linear_matches_masked_dense_forward_and_backward(transposable):
    torch.manual_seed(0)
    dims = [(256, 128), (128, 256)]
    ref = Stack(dims).cuda()
    sp = Stack(dims).cuda()
    sp.load_state_dict(ref.state_dict())
    kw = dict(
        sparsity=0.5,
        granularity="nm",
        transposable=transposable,
        total_steps=10,
        include=["layers.*"],
    )
    DynamicSparsity(ref, None, **kw)
    dst = DynamicSparsity(sp, None, semi_structured=True, **kw)
    assert dst.semi_structured == ["layers.0.weight", "layers.1.weight"]
    x = torch.randn(4, 64, 128, device="cuda")
    y_ref, g_ref = _grads(ref, x)
    y, g = _grads(sp, x)
    torch.testing.assert_close(y, y_ref, rtol=2e-2, atol=2e-2 * y_ref.abs().max().item())
    for a, b, lin in zip(g, g_ref, sp.layers):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * b.abs().max().item())
        assert (a[~lin.weight_mask] != 0).float().mean() > 0.9  # dense weight gradient for RigL


def test_semi_structured_on_a_gpu_without_2_4_tensor_cores_is_a_config_error(monkeypatch):
    """Checked before any mask work; the device query is faked so this runs on any machine."""
    from moezoo.configs import ConfigError
    from moezoo.layers.dst.semi_structured import check_semi_structured_device

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Tesla T4")
    with pytest.raises(ConfigError) as e:
        check_semi_structured_device(torch.device("cuda", 0))
    assert e.value.key == "dst.semi_structured" and "\n" not in str(e.value)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_semi_structured_device(torch.device("cuda", 0))
    check_semi_structured_device(torch.device("cpu"))  # CPU: the masked dense reference
