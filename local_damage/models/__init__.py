"""The LOCAL model: shared Siamese encoder, latent feature correlation, projection and classifier.

``build_model(ModelConfig(...))`` gives a :class:`LocalNet`; its ``forward(pre, post)`` returns a
:class:`LocalOutput` for training, ``predict(pre, post)`` the ``(logits, z)`` pair that
:class:`LocalInference` exposes for ONNX export.
"""

from local_damage.models.correlation import (
    Correlation,
    LatentCorrelation,
    format_blocks,
    parse_blocks,
    resize_map,
)
from local_damage.models.encoders import (
    EncoderError,
    WeightsFileNotFoundError,
    WeightsReport,
    WeightsUnavailableError,
    build_encoder,
    checkpointed_features,
    encoder_names,
    load_encoder_weights,
    read_state_dict,
)
from local_damage.models.local_net import (
    LocalInference,
    LocalNet,
    LocalOutput,
    ModelConfig,
    build_model,
)

__all__ = [
    "Correlation",
    "EncoderError",
    "LatentCorrelation",
    "LocalInference",
    "LocalNet",
    "LocalOutput",
    "ModelConfig",
    "WeightsFileNotFoundError",
    "WeightsReport",
    "WeightsUnavailableError",
    "build_encoder",
    "build_model",
    "checkpointed_features",
    "encoder_names",
    "format_blocks",
    "load_encoder_weights",
    "parse_blocks",
    "read_state_dict",
    "resize_map",
]
