"""Neuron-level expert routing for FFNs: hidden units clustered into groups, each token computes its
top-k.

- ``ffn``: ``NeuronRoutedFFN``; ``NeuronSchedule`` (the layers' schedule as one sparsity method for
  the trainer).
- ``cluster``: balanced k-means of the FFN's rows into groups.
- ``schedule``: dense warm-up, sparse/dense alternation, dense finish.
"""

from .ffn import NeuronRoutedFFN, NeuronSchedule, neuron_schedule_step, neuron_stats

__all__ = ["NeuronSchedule", "NeuronRoutedFFN", "neuron_schedule_step", "neuron_stats"]
