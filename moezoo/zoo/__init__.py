"""Model assembly from config, presets (``zoo/*.yaml``), HF import/export."""

from moezoo import _checkout_path

__path__ = _checkout_path(__path__, "zoo")
from .model import Transformer, TransformerBlock, build_model

__all__ = ["Transformer", "TransformerBlock", "build_model"]
