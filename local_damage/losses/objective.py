"""The LOCAL training objective, its baselines, and the schedules of the weight alpha.

Methods (Sec. 3.4 and Appendix A.2 of the LOCAL paper), selected by name through `METHODS`:

- ``local``: ``alpha * (OCL(z) + beta * OCL(l)) + (1 - alpha) * WCE`` (Eq. 5, 6).
- ``l-scl``: ``alpha * (SCL(z) + beta * SCL(l)) + (1 - alpha) * WCE``.
- ``scl``:   ``alpha * SCL(z) + (1 - alpha) * WCE`` (no latent branch).
- ``ce``:    ``WCE`` alone (alpha is ignored).

``z`` is the joint embedding of a pair [B, D_E], ``l`` the latent correlation embedding [B, D_L],
WCE the cross-entropy weighted by inverse class frequency (`class_weights`).

alpha decays with the epoch ("inversely proportional to the number of epochs", Eq. 6). Epochs
are counted from 0 and the schedules are:

- ``constant``: ``alpha0``.
- ``inverse`` (default): ``max(alpha_min, alpha0 / (1 + epoch))``, i.e. ``alpha0 / epoch`` with
  1-based epochs: 0.5, 0.25, 0.167, ... for the default ``alpha0 = 0.5``.
- ``linear``: ``alpha0`` at epoch 0 down to ``alpha_min`` at the last epoch (``epochs - 1``).

The default ``alpha0 = 0.5`` (rather than the literal ``1 / epoch``, which starts at 1) keeps the
classifier trained from the first epoch, so a short run still yields a usable model.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
from torch import nn

from local_damage.losses.orthonormal import OrthonormalContrastiveLoss
from local_damage.losses.supcon import SupConLoss
from local_damage.losses.weighted_ce import WeightedCrossEntropy


class MethodSpec(NamedTuple):
    """What a training method needs: its contrastive loss ("ocl", "scl" or None) and latent use."""

    contrastive: str | None
    latent: bool
    description: str


METHODS: dict[str, MethodSpec] = {
    "local": MethodSpec("ocl", True, "alpha*(OCL(z) + beta*OCL(l)) + (1-alpha)*WCE"),
    "l-scl": MethodSpec("scl", True, "alpha*(SCL(z) + beta*SCL(l)) + (1-alpha)*WCE"),
    "scl": MethodSpec("scl", False, "alpha*SCL(z) + (1-alpha)*WCE"),
    "ce": MethodSpec(None, False, "WCE"),
}

ALPHA_SCHEDULES = ("constant", "inverse", "linear")

_CONTRASTIVE = {"ocl": OrthonormalContrastiveLoss, "scl": SupConLoss}


def check_method(method: str) -> str:
    """Return ``method`` if it names a method in `METHODS`, else raise a ``ValueError`` listing them."""
    if method not in METHODS:
        raise ValueError(
            f"unknown loss method {method!r}; valid methods: {', '.join(sorted(METHODS))}"
        )
    return method


def uses_latent(method: str) -> bool:
    """Whether ``method`` needs the model's latent correlation embedding ``l``."""
    return METHODS[check_method(method)].latent


def alpha_at(
    epoch: int,
    *,
    schedule: str = "inverse",
    alpha0: float = 0.5,
    alpha_min: float = 0.0,
    epochs: int | None = None,
) -> float:
    """The weight alpha of the contrastive term at a 0-based ``epoch``.

    Args:
        epoch: 0-based epoch index (>= 0).
        schedule: "constant", "inverse" or "linear" (see the module docstring).
        alpha0: alpha at epoch 0, in [0, 1].
        alpha_min: floor of "inverse" and end point of "linear", in [0, alpha0].
        epochs: total number of epochs; required by "linear". Past the last epoch "linear" stays
            at ``alpha_min``.

    Returns:
        alpha in [0, 1].
    """
    if schedule not in ALPHA_SCHEDULES:
        raise ValueError(
            f"unknown alpha schedule {schedule!r}; valid schedules: {', '.join(ALPHA_SCHEDULES)}"
        )
    if not 0.0 <= alpha0 <= 1.0:
        raise ValueError(f"alpha0 must be in [0, 1], got {alpha0}")
    if not 0.0 <= alpha_min <= alpha0:
        raise ValueError(f"alpha_min must be in [0, alpha0={alpha0}], got {alpha_min}")
    if epoch < 0:
        raise ValueError(f"epoch is 0-based and must be >= 0, got {epoch}")
    if schedule == "constant":
        return float(alpha0)
    if schedule == "inverse":
        return float(max(alpha_min, alpha0 / (1 + epoch)))
    if epochs is None or epochs < 1:
        raise ValueError(f"the linear alpha schedule needs epochs >= 1, got {epochs}")
    if epochs == 1:
        return float(alpha0)
    frac = min(epoch, epochs - 1) / (epochs - 1)
    return float(alpha0 + (alpha_min - alpha0) * frac)


class Objective(nn.Module):
    """A training objective: weighted CE plus, for contrastive methods, the alpha-weighted term.

    Build with `build_objective`. Calling it returns ``(total, parts)`` where ``total`` is the
    scalar to backpropagate and ``parts`` holds detached scalars: ``wce``, ``total``, and for
    contrastive methods ``alpha``, ``contrastive_z`` and (latent methods) ``contrastive_l``.

    Shape:
        - logits: [B, K]; labels: [B] integers.
        - z: [B, D_E] joint embedding (contrastive methods); l: [B, D_L] latent embedding
          (latent methods; ignored otherwise).
        - alpha: float in [0, 1] (contrastive methods; ignored by "ce").
        - contrastive_labels: [B'] labels of the rows of z and l when those are not the rows of
          logits (e.g. embeddings gathered from every process in distributed training);
          default ``labels``.
    """

    def __init__(
        self,
        method: str,
        temperature: float = 0.1,
        beta: float = 1.0,
        class_weights: torch.Tensor | None = None,
        normalize_z: bool = True,
    ) -> None:
        super().__init__()
        self.method = check_method(method)
        spec = METHODS[method]
        beta = float(beta)
        if not beta >= 0.0:
            raise ValueError(f"beta must be >= 0, got {beta}")
        self.beta = beta
        self.latent = spec.latent
        self.wce = WeightedCrossEntropy(class_weights)
        self.normalize_z = bool(normalize_z)
        self.contrastive = _CONTRASTIVE[spec.contrastive](temperature) if spec.contrastive else None
        # z compared by cosine (the default) or by raw inner products; l is always unit norm.
        self.contrastive_z = (
            _CONTRASTIVE[spec.contrastive](temperature, normalize=self.normalize_z)
            if spec.contrastive
            else None
        )

    def forward(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        z: torch.Tensor | None = None,
        l: torch.Tensor | None = None,  # noqa: E741 - the paper's name for the latent embedding
        alpha: float | None = None,
        contrastive_labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        wce = self.wce(logits, labels)
        if self.contrastive is None:
            return wce, {"wce": wce.detach(), "total": wce.detach()}
        if alpha is None or not 0.0 <= float(alpha) <= 1.0:
            raise ValueError(f"method {self.method!r} needs alpha in [0, 1], got {alpha!r}")
        if z is None:
            raise ValueError(f"method {self.method!r} needs the embedding z")
        con_labels = labels if contrastive_labels is None else contrastive_labels
        parts: dict[str, torch.Tensor] = {"wce": wce.detach()}
        con = self.contrastive_z(z, con_labels)
        parts["contrastive_z"] = con.detach()
        if self.latent:
            if l is None:
                raise ValueError(
                    f"method {self.method!r} needs the latent embedding l (see uses_latent)"
                )
            con_l = self.contrastive(l, con_labels)
            parts["contrastive_l"] = con_l.detach()
            con = con + self.beta * con_l
        alpha = float(alpha)
        total = alpha * con + (1.0 - alpha) * wce
        parts["alpha"] = torch.tensor(alpha)
        parts["total"] = total.detach()
        return total, parts

    def extra_repr(self) -> str:
        return f"method={self.method!r}, beta={self.beta}, normalize_z={self.normalize_z}"


def build_objective(
    method: str,
    temperature: float = 0.1,
    beta: float = 1.0,
    class_weights: torch.Tensor | None = None,
    normalize_z: bool = True,
) -> Objective:
    """Build the objective named ``method`` (one of `METHODS`).

    Args:
        method: "local", "l-scl", "scl" or "ce".
        temperature: contrastive temperature t > 0.
        beta: weight of the latent term (latent methods), >= 0.
        class_weights: [K] WCE weights (`class_weights`), or None for unweighted CE.
        normalize_z: compare the rows of ``z`` by cosine (True) or by raw inner products.
    """
    return Objective(
        method,
        temperature=temperature,
        beta=beta,
        class_weights=class_weights,
        normalize_z=normalize_z,
    )


@dataclass
class LossConfig:
    """Loss settings of a training run (saved with the run and the exported model).

    Attributes:
        method: one of `METHODS` ("local", "l-scl", "scl", "ce").
        temperature: contrastive temperature; the paper gives no value, 0.1 is ours (the usual
            SupCon choice, Khosla et al. 2020).
        beta: weight of the latent term ``OCL(l)`` (Eq. 5); 1.0 weighs both embeddings equally.
        alpha0: alpha at epoch 0.
        alpha_schedule: "constant", "inverse" or "linear" (see `alpha_at`).
        alpha_min: floor of "inverse", end point of "linear".
        normalize_z: the contrastive loss on ``z`` compares pairs by cosine (True: the unit
            vectors the paper's theorems take) or by the raw inner products of the unnormalised
            ``z = W [e_pre, e_post]`` (False: ``e`` is unit norm but ``z`` is not re-normalised,
            so an unchanged building has a short ``z`` and inner products reach 4; a departure
            from the paper that the previous default recipe, configs/default.yaml, takes; the
            bundled model's, configs/cpu-local-general.yaml, and configs/cpu-local.yaml compare
            unit vectors).
        weight_power: exponent ``p`` of the cross-entropy's class weights ``n_c^-p``
            (:func:`local_damage.losses.weighted_ce.class_weights`): 1 the paper's inverse
            frequency, 0.5 the square root.
    """

    method: str = "local"
    temperature: float = 0.1
    beta: float = 1.0
    alpha0: float = 0.5
    alpha_schedule: str = "inverse"
    alpha_min: float = 0.0
    normalize_z: bool = True
    weight_power: float = 1.0

    def __post_init__(self) -> None:
        check_method(self.method)
        if not float(self.weight_power) >= 0:
            raise ValueError(f"weight_power must be >= 0, got {self.weight_power}")
        if not float(self.temperature) > 0:
            raise ValueError(f"temperature must be > 0, got {self.temperature}")
        if not float(self.beta) >= 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        # validates schedule name, alpha0 and alpha_min
        alpha_at(
            0, schedule=self.alpha_schedule, alpha0=self.alpha0, alpha_min=self.alpha_min, epochs=1
        )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LossConfig:
        """Build from a mapping (e.g. a YAML section); unknown keys are an error."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown loss config keys {unknown}; valid keys: {', '.join(sorted(known))}"
            )
        return cls(**dict(data))

    def to_dict(self) -> dict[str, Any]:
        """The config as a plain dict."""
        return asdict(self)

    def alpha(self, epoch: int, epochs: int | None = None) -> float:
        """alpha at a 0-based ``epoch`` of ``epochs`` (see `alpha_at`)."""
        return alpha_at(
            epoch,
            schedule=self.alpha_schedule,
            alpha0=self.alpha0,
            alpha_min=self.alpha_min,
            epochs=epochs,
        )

    def build(self, class_weights: torch.Tensor | None = None) -> Objective:
        """The `Objective` of this config."""
        return build_objective(
            self.method, self.temperature, self.beta, class_weights, self.normalize_z
        )
