"""Layers that keep ``aux_loss`` (MoE, the neuron-routed FFN) stay copyable after a training step:
an EMA copy (``copy.deepcopy``) or a pickled whole module (``torch.save``) holds the loss detached,
and the live module's loss still backpropagates."""

import copy
import io

import pytest
import torch

from moezoo.layers import MoE, NeuronRoutedFFN, total_aux_loss


@pytest.mark.parametrize(
    "make",
    [
        lambda: MoE(32, 48, 4, 2, backend="torch", aux_loss_coef=0.1),
        lambda: NeuronRoutedFFN(32, 64, 8, 2, backend="torch"),
    ],
    ids=["moe", "neuron"],
)
def test_a_layer_that_ran_forward_copies_and_pickles_with_its_aux_loss_detached(make):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 32), make())
    y = m(torch.randn(24, 32))
    aux = total_aux_loss(m)
    assert aux.requires_grad
    ema = copy.deepcopy(m)  # what an EMA of the model does after a step
    buf = io.BytesIO()
    torch.save(m, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for c in (ema, loaded):
        assert not c[1].aux_loss.requires_grad
        torch.testing.assert_close(c[1].aux_loss, m[1].aux_loss.detach())
        for (n, p), q in zip(m.named_parameters(), c.parameters()):
            torch.testing.assert_close(q, p, msg=n)
    (y.square().mean() + aux).backward()  # the live module kept its graph
    assert m[1].aux_loss.requires_grad and m[0].weight.grad is not None
