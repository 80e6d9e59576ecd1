"""Model assembly from config, presets (``zoo/*.yaml``), HF import/export."""
from .model import Transformer, TransformerBlock, build_model

__all__ = ["Transformer", "TransformerBlock", "build_model"]
