"""Typed config schema, YAML loading with includes, dotted overrides and validation.

Imported by every other package; imports none of them.
"""

from moezoo import _checkout_path

__path__ = _checkout_path(__path__, "configs")
from .attention import AttentionConfig, validate_pattern
from .config import Config
from .dst import DSTConfig
from .errors import ConfigError, exit_code
from .loader import load_config, save_config, to_dict
from .mla import MLAConfig
from .model import ModelConfig, RopeScalingConfig
from .moe import MoEConfig
from .neuron import NeuronConfig
from .parallel import ParallelConfig
from .ranges import assign_ranges, parse_range
from .run import CheckpointConfig, DataConfig, LoggingConfig, OptimConfig, TrainConfig

__all__ = [
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DSTConfig",
    "DataConfig",
    "LoggingConfig",
    "MLAConfig",
    "MoEConfig",
    "ModelConfig",
    "NeuronConfig",
    "OptimConfig",
    "ParallelConfig",
    "RopeScalingConfig",
    "TrainConfig",
    "assign_ranges",
    "exit_code",
    "load_config",
    "parse_range",
    "save_config",
    "to_dict",
    "validate_pattern",
]
