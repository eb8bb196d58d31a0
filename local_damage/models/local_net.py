"""The LOCAL Siamese network (paper Sec. 3.4, Fig. 6; baselines in Appendix A.2).

One shared encoder runs the pre and post images as a single batch of ``2B``. From its feature maps:

- ``r`` = global average pool of the last map, L2-normalised (the paper puts ``r`` on the unit
  hypersphere), ``[B, D_R]`` per branch;
- the classifier, an MLP on ``concat(r_pre, r_post)``, gives the logits ``[B, K]``;
- the projection, an MLP shared by both branches, gives ``e_pre``, ``e_post`` ``[B, D_E]``,
  L2-normalised; ``z = normalise(W [e_pre, e_post])`` with ``W = [I, -I]`` by default;
- the latent hierarchical correlation module (:class:`LatentCorrelation`) gives ``l`` ``[B, D_L]``
  and its map ``[B, 1, S, S]``; disabled (``latent_blocks=None`` or ``""``) for the SCL baseline.

``z`` is zero (not unit norm) only when ``e_pre == e_post`` exactly, e.g. identical images.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from local_damage.models.correlation import (
    Correlation,
    LatentCorrelation,
    format_blocks,
    parse_blocks,
)
from local_damage.models.encoders import build_encoder, checkpointed_features, feature_channels


@dataclass
class ModelConfig:
    """Everything needed to rebuild a :class:`LocalNet`.

    Attributes:
        encoder: smp encoder name (``resnet18``/``resnet34``/``resnet50`` as in the paper, or any
            other smp name). The paper's main results use ResNet-50.
        weights: ``None`` for random initialisation, a local weights file (``.pth`` or
            ``.safetensors``), or smp hub weights such as ``"imagenet"`` (needs network or cache).
        latent_blocks: Encoder blocks of the latent module, e.g. ``"1-2-3-4"`` (the paper's best on
            HRA), ``"2-3-4"``, ``"3-4"``, ``"4"``; ``None`` or ``""`` disables it (SCL baseline).
        learnable_correlation: Learn ``W`` (initialised to ``[I, -I]``) in the latent module and
            for ``z`` instead of the fixed difference the paper uses.
        latent_abs: Average the absolute correlation ``|W_i [f_pre, f_post]|`` over channels
            instead of the signed one the paper describes. Every entry of ``l`` is then ``>= 0``,
            so OCL on ``l`` is exactly SCL on ``l`` unless ``latent_centre`` is set (the
            previous default recipe, configs/default.yaml, does this; the bundled model's,
            configs/cpu-local-general.yaml, and configs/cpu-local.yaml do not; see
            docs/method.md).
        latent_centre: Centre ``l`` over its ``S x S`` positions before L2-normalising it, so
            its inner products take both signs and OCL pushes negatives to perpendicular from
            both sides (a reading of the paper's "flattened and normalized" as standardised;
            with ``latent_abs`` it is what makes the latent term orthonormal at all).
        latent_size: Side ``S`` of the common grid of the latent maps (``D_L = S * S``). The
            default 8 is the block-3 grid of a 128 px chip (blocks 1-4 are 32, 16, 8, 4 px there),
            the middle of the hierarchy: two blocks are pooled, one up-sampled, none by more than
            4x; ``D_L = 64`` is of the order of ``D_E``. It also fixes ``D_L`` whatever the chip
            size.
        proj_hidden: Hidden width of the projection MLP.
        embed_dim: ``D_E``, the size of ``e`` and ``z``.
        cls_hidden: Hidden width of the classifier MLP.
        num_classes: ``K``, the number of damage classes.
        dropout: Dropout before the classifier's output layer (0 = none, as in the paper).
        normalize_r: L2-normalise ``r`` before both heads, as the paper states.
        channels_last: Run the encoder in channels-last memory format (faster convolutions on
            recent GPUs with mixed precision).
        gradient_checkpointing: Recompute encoder activations in backward instead of keeping
            them (less memory, about one more encoder forward of time).
        pair_norm: Radiometric normalisation of each pair inside the network (and so inside the
            exported graph): each channel of the post chip is shifted and scaled to the mean and
            standard deviation of the pre chip's (:func:`match_radiometry`), so a new sensor's
            or season's overall colour and contrast are not read as change. Not in the paper.
    """

    encoder: str = "resnet50"
    weights: str | None = None
    latent_blocks: str | None = "1-2-3-4"
    learnable_correlation: bool = False
    latent_abs: bool = False
    latent_centre: bool = False
    latent_size: int = 8
    proj_hidden: int = 512
    embed_dim: int = 128
    cls_hidden: int = 512
    num_classes: int = 4
    dropout: float = 0.0
    normalize_r: bool = True
    channels_last: bool = False
    gradient_checkpointing: bool = False
    pair_norm: bool = False

    def __post_init__(self) -> None:
        blocks = parse_blocks(self.latent_blocks)
        self.latent_blocks = format_blocks(blocks) or None
        if self.weights is not None:
            self.weights = str(self.weights)
        for name in ("latent_size", "proj_hidden", "embed_dim", "cls_hidden"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model config: {name} must be a positive integer, got {value!r}")
        if not isinstance(self.num_classes, int) or self.num_classes < 2:
            raise ValueError(f"model config: num_classes must be >= 2, got {self.num_classes!r}")
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"model config: dropout must be in [0, 1), got {self.dropout!r}")

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelConfig:
        """Build from a mapping (e.g. parsed YAML); unknown keys are an error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"model config: unknown keys {unknown}; known keys are {sorted(known)}"
            )
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form, for saving with checkpoints and exported models."""
        return dataclasses.asdict(self)


class LocalOutput(NamedTuple):
    """What :meth:`LocalNet.forward` returns for a batch of ``B`` pairs.

    Attributes:
        logits: ``[B, K]`` class scores for the weighted cross-entropy.
        z: ``[B, D_E]`` unit-norm joint embedding for the contrastive loss.
        l: ``[B, D_L]`` unit-norm latent embedding, or ``None`` when the latent module is off.
        e_pre: ``[B, D_E]`` unit-norm projection of the pre image.
        e_post: ``[B, D_E]`` unit-norm projection of the post image.
        latent_map: ``[B, 1, S, S]`` channel-averaged correlation map (where the features
            changed), or ``None`` when the latent module is off.
        z_raw: ``[B, D_E]`` ``W [e_pre, e_post]`` before normalisation (``z`` is its direction).
    """

    logits: torch.Tensor
    z: torch.Tensor
    l: torch.Tensor | None  # noqa: E741 - the paper's name
    e_pre: torch.Tensor
    e_post: torch.Tensor
    latent_map: torch.Tensor | None = None
    z_raw: torch.Tensor | None = None


#: Bounds of the gain :func:`match_radiometry` applies to a post channel, and the variance floor
#: (normalised units; 1e-3 is about 1.8 grey levels of standard deviation) below which a channel
#: counts as flat: a flat chip is shifted, not stretched.
PAIR_GAIN = (1.0 / 3.0, 3.0)
PAIR_VAR_FLOOR = 1e-3


def match_radiometry(pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
    """``post`` with each channel's mean and standard deviation over the chip set to ``pre``'s.

    ``post' = (post - mean_post) * g + mean_pre`` with ``g = sd_pre / sd_post`` clipped to
    :data:`PAIR_GAIN` (variances floored at :data:`PAIR_VAR_FLOOR`). Per channel and affine, so
    it commutes with the per-channel input normalisation: the same on 0-255 or normalised values.

    Args:
        pre: ``[B, C, H, W]`` float.
        post: ``[B, C, H, W]`` float, the same shape.

    Returns:
        ``[B, C, H, W]``, the matched post images.
    """
    mean_pre = pre.mean(dim=(2, 3), keepdim=True)
    mean_post = post.mean(dim=(2, 3), keepdim=True)
    var_pre = (pre - mean_pre).pow(2).mean(dim=(2, 3), keepdim=True)
    var_post = (post - mean_post).pow(2).mean(dim=(2, 3), keepdim=True)
    gain = torch.sqrt(var_pre.clamp_min(PAIR_VAR_FLOOR) / var_post.clamp_min(PAIR_VAR_FLOOR))
    gain = gain.clamp(PAIR_GAIN[0], PAIR_GAIN[1])
    return (post - mean_post) * gain + mean_pre


def _mlp(d_in: int, hidden: int, d_out: int, dropout: float = 0.0) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(d_in, hidden), nn.ReLU(inplace=True)]
    if dropout > 0:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(hidden, d_out))
    return nn.Sequential(*layers)


class LocalNet(nn.Module):
    """Siamese encoder, latent correlation module, projection and classifier.

    Args:
        cfg: The model configuration.
        encoder: A ready encoder to use instead of building one from ``cfg`` (tests, reuse).

    Inputs are float tensors ``[B, 3, H, W]``, already normalised; pre and post have the same
    shape. ``H`` and ``W`` should be multiples of 32 (the encoder's stride).
    """

    def __init__(self, cfg: ModelConfig, encoder: nn.Module | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.encoder = encoder if encoder is not None else build_encoder(cfg.encoder, cfg.weights)
        channels = feature_channels(self.encoder)
        d_r = channels[-1]
        blocks = parse_blocks(cfg.latent_blocks)
        self.latent = (
            LatentCorrelation(
                channels,
                blocks,
                cfg.latent_size,
                cfg.learnable_correlation,
                cfg.latent_abs,
                cfg.latent_centre,
            )
            if blocks
            else None
        )
        self.projection = _mlp(d_r, cfg.proj_hidden, cfg.embed_dim)
        self.correlation = Correlation(cfg.embed_dim, cfg.learnable_correlation)
        self.classifier = _mlp(2 * d_r, cfg.cls_hidden, cfg.num_classes, cfg.dropout)
        if cfg.channels_last:
            self.to(memory_format=torch.channels_last)

    @property
    def latent_dim(self) -> int | None:
        """``D_L``, or ``None`` when the latent module is off."""
        return None if self.latent is None else self.latent.dim

    def encode_pair(
        self, pre: torch.Tensor, post: torch.Tensor
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run pre and post through the shared encoder as one batch of ``2B``.

        Returns:
            The 6 feature maps of the pre images and of the post images, ``[B, C_k, H_k, W_k]``.
        """
        if not torch.jit.is_tracing() and pre.shape != post.shape:
            raise ValueError(
                f"pre and post batches differ in shape: {tuple(pre.shape)} vs {tuple(post.shape)}"
            )
        b = pre.shape[0]
        if self.cfg.pair_norm:
            post = match_radiometry(pre, post)
        x = torch.cat([pre, post], dim=0)
        if self.cfg.channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        if self.cfg.gradient_checkpointing and self.training and torch.is_grad_enabled():
            feats = checkpointed_features(self.encoder, x)
        else:
            feats = self.encoder(x)
        return [f[:b] for f in feats], [f[b:] for f in feats]

    def _heads(
        self, f_pre: torch.Tensor, f_post: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pooled representations to ``(logits, z, e_pre, e_post)``."""
        logits, z_raw, e_pre, e_post = self._heads_raw(f_pre, f_post)
        return logits, F.normalize(z_raw, dim=1), e_pre, e_post

    def _heads_raw(
        self, f_pre: torch.Tensor, f_post: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pooled representations to ``(logits, z_raw, e_pre, e_post)``, ``z`` unnormalised."""
        r_pre = f_pre.mean(dim=(2, 3))
        r_post = f_post.mean(dim=(2, 3))
        if self.cfg.normalize_r:
            r_pre = F.normalize(r_pre, dim=1)
            r_post = F.normalize(r_post, dim=1)
        logits = self.classifier(torch.cat([r_pre, r_post], dim=1))
        e_pre = F.normalize(self.projection(r_pre), dim=1)
        e_post = F.normalize(self.projection(r_post), dim=1)
        return logits, self.correlation(e_pre, e_post), e_pre, e_post

    def forward(self, pre: torch.Tensor, post: torch.Tensor) -> LocalOutput:
        """Everything training needs.

        Args:
            pre: ``[B, 3, H, W]`` normalised pre-event images.
            post: ``[B, 3, H, W]`` normalised post-event images.

        Returns:
            A :class:`LocalOutput`.
        """
        feats_pre, feats_post = self.encode_pair(pre, post)
        logits, z_raw, e_pre, e_post = self._heads_raw(feats_pre[-1], feats_post[-1])
        l_emb = latent_map = None
        if self.latent is not None:
            l_emb, latent_map = self.latent(feats_pre, feats_post)
        z = F.normalize(z_raw, dim=1)
        return LocalOutput(logits, z, l_emb, e_pre, e_post, latent_map, z_raw)

    def predict(self, pre: torch.Tensor, post: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Inference path: ``(logits [B, K], z [B, D_E])``, skipping the latent module."""
        feats_pre, feats_post = self.encode_pair(pre, post)
        logits, z, _, _ = self._heads(feats_pre[-1], feats_post[-1])
        return logits, z

    def change_map(self, pre: torch.Tensor, post: torch.Tensor) -> torch.Tensor:
        """The latent correlation map ``[B, 1, S, S]`` ("where the model saw change").

        Raises:
            ValueError: The latent module is off (``latent_blocks`` empty).
        """
        if self.latent is None:
            raise ValueError("this model has no latent correlation module (latent_blocks is empty)")
        feats_pre, feats_post = self.encode_pair(pre, post)
        return self.latent.latent_map(feats_pre, feats_post)


class LocalInference(nn.Module):
    """Export wrapper: ``forward(pre, post)`` returns exactly ``(logits, z)``.

    With ``with_change_map=True`` it returns ``(logits, z, change_map)``, the map ``[B, 1, S, S]``
    of :meth:`LocalNet.change_map`, from the same single encoder pass.

    Args:
        model: A trained :class:`LocalNet`; put it in ``eval()`` mode before exporting.
        with_change_map: Also return the latent correlation map.
    """

    def __init__(self, model: LocalNet, with_change_map: bool = False) -> None:
        super().__init__()
        if with_change_map and model.latent is None:
            raise ValueError("with_change_map needs a model with a latent correlation module")
        self.model = model
        self.with_change_map = with_change_map

    def forward(self, pre: torch.Tensor, post: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if not self.with_change_map:
            return self.model.predict(pre, post)
        feats_pre, feats_post = self.model.encode_pair(pre, post)
        logits, z, _, _ = self.model._heads(feats_pre[-1], feats_post[-1])
        return logits, z, self.model.latent.latent_map(feats_pre, feats_post)


def build_model(cfg: ModelConfig) -> LocalNet:
    """Build a :class:`LocalNet` from its configuration (encoder weights loaded as configured)."""
    return LocalNet(cfg)
