"""kernels.launch.to_device: the value arrives, and on CUDA the host does not wait for queued
work."""

import pytest
import torch

from moezoo.kernels.launch import to_device


def test_to_device_on_cpu_is_the_tensor_itself():
    t = torch.randint(0, 100, (3, 5))
    assert to_device(t, "cpu") is t


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_queues_the_copy_behind_running_work_without_waiting():
    t = torch.randint(0, 50_000, (4, 4096))[:, :-1]  # a strided view, as a batch's inputs are
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles queued ahead of the copy
    d = to_device(t, "cuda")
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert still_busy, "to_device waited for the GPU's queued work"
    assert d.is_cuda and torch.equal(d.cpu(), t)
