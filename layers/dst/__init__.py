"""Weight-level dynamic sparse training.

- ``dynamic_sparsity``: ``DynamicSparsity`` (masks on chosen weights, prune/grow on a schedule).
- ``masks``: ERK densities, RigL / SET / magnitude updates, blocks and N:M selection.
- ``schedule``: the sparsity ramp and drop-fraction schedule.
- ``semi_structured``: 2:4 layers through torch's semi-structured sparse kernels on GPU.
"""

from .dynamic_sparsity import DynamicSparsity

__all__ = ["DynamicSparsity"]
