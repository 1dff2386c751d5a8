"""Model definitions. One transformer serves every supported `model_type`."""

from infer.models.transformer import Transformer

__all__ = ["Transformer"]
