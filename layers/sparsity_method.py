"""The one protocol the trainer loops over for every sparsity method that acts between steps.

A method is anything with these four calls (``typing.Protocol``: no base class to inherit):

- ``before_step(step)``: before the forward of optimizer step ``step`` (0-based), e.g. the
  neuron-routed FFN's dense / sparse phase for that step;
- ``after_optimizer_step(step)``: right after ``optimizer.step()`` of a step whose update was
  applied, e.g. DST's mask update, MoE's aux-loss-free bias update;
- ``skipped_step()``: the step's update was not applied (non-finite loss or gradients) or the run
  rolled back: drop whatever the step's forward accumulated for the next update (MoE's routed-token
  counts);
- ``metrics() -> dict``: scalars to log (tensors are fine; the trainer copies them to the host
  once).

A method whose class sets ``skips_on_device = True`` also takes ``after_optimizer_step(step,
applied)``: ``applied`` a 0-dim float32 tensor on the device, 1 if the step's update was applied and
0 if it was skipped, which the host has not read; the method does on the device what either call
above would (no ``skipped_step()`` follows for that step). The trainer then checks steps without a
host sync (training.loop.skips_on_device). Such a method may also have ``decides_on_host(step) ->
bool``: the steps whose work needs the outcome on the host (DST's mask updates and the first step of
its dense finish); the trainer then reads that step's check at once and calls it without
``applied``.

Implemented by ``layers.moe.ExpertBalancing``, ``layers.neuron.NeuronSchedule`` and
``layers.dst.DynamicSparsity``. Hand-built models use them the same way as the trainer does.
"""

from __future__ import annotations

from typing import Optional, Protocol, runtime_checkable

import torch


@runtime_checkable
class SparsityMethod(Protocol):
    def before_step(self, step: int) -> None: ...

    def after_optimizer_step(self, step: int, applied: Optional[torch.Tensor] = None) -> None: ...

    def skipped_step(self) -> None: ...

    def metrics(self) -> dict: ...
