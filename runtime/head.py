"""The adapted head a model file may carry, applied at run time (no torch).

``local-damage adapt`` (:mod:`app.adapt.fit`) fits a small head on a model's embedding ``z`` and
raw logits from a few labelled buildings of a new event and stores it in the ``adaptation``
metadata prop; :class:`runtime.predictor.Predictor` reads it with :func:`read_head` and returns
:meth:`Head.scores` as the logits. How the head treats classes without a label is told in
:mod:`app.adapt.fit`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

#: Metadata prop of a model file holding the adapted head.
METADATA_KEY = "adaptation"


#: Text of the features every head reads, recorded in the metadata.
FEATURES = (
    "the unit-length embedding [D], then the base model's log-probabilities of the labelled "
    "classes renormalised over them [|L|]"
)


def log_softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``[N, K]`` scores, float64."""
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=1, keepdims=True))


def _logsumexp(x: np.ndarray) -> np.ndarray:
    m = x.max(axis=1, keepdims=True)
    return (m + np.log(np.exp(x - m).sum(axis=1, keepdims=True)))[:, 0]


def unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length in float64 (zero rows stay zero)."""
    a = np.asarray(x, dtype=np.float64)
    n = np.linalg.norm(a, axis=-1, keepdims=True)
    return np.divide(a, n, out=np.zeros_like(a), where=n > 1e-12)


@dataclass
class Head:
    """A fitted head: ``q = softmax(W [z, log p_base(. | L)] + b)`` over the labelled classes.

    Attributes:
        method: one of :data:`METHODS`.
        classes: the labelled class ids ``L`` (sorted), the only ones the head re-scores.
        weights: float64 ``[|L|, D + |L|]``.
        bias: float64 ``[|L|]``.
        base_temperature: ``T0`` of the base model's probabilities (1 when uncalibrated).
        k: the number of classes of the model.
        discount: float64 ``[K]``: ``rho_c`` of each class without a label (1 for the labelled
            classes, and for every class under the ``keep`` rule); None: all ones.
    """

    method: str
    classes: list[int]
    weights: np.ndarray
    bias: np.ndarray
    base_temperature: float
    k: int
    discount: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.discount is None:
            self.discount = np.ones(self.k)

    @property
    def unlabelled(self) -> list[int]:
        """The class ids without a label (not in :attr:`classes`)."""
        return [c for c in range(self.k) if c not in self.classes]

    def features(self, raw_logits: np.ndarray, embedding: np.ndarray) -> np.ndarray:
        """``[N, D + |L|]`` head input of raw ``[N, K]`` logits and ``[N, D]`` embeddings."""
        b = log_softmax(np.asarray(raw_logits, np.float64) / self.base_temperature)
        bl = b[:, self.classes]
        return np.hstack([unit(embedding), bl - _logsumexp(bl)[:, None]])

    def log_probabilities(self, raw_logits: np.ndarray, embedding: np.ndarray) -> np.ndarray:
        """float64 ``[N, K]`` adapted log-probabilities (module docstring)."""
        b = log_softmax(np.asarray(raw_logits, np.float64) / self.base_temperature)
        if len(b) == 0:
            return b
        rho = np.asarray(self.discount, np.float64)
        out = b + np.log(rho)[None, :]
        others = self.unlabelled
        # m_L = sum_{c in L} p_base(c) + sum_{c not in L} (1 - rho_c) p_base(c), in logs
        with np.errstate(divide="ignore"):  # rho = 1 frees nothing: log 0
            freed = b[:, others] + np.log1p(-rho[others])[None, :]
        mass = _logsumexp(np.hstack([b[:, self.classes], freed]))[:, None]
        q = log_softmax(self.features(raw_logits, embedding) @ self.weights.T + self.bias)
        out[:, self.classes] = mass + q
        return out

    def scores(self, raw_logits: np.ndarray, embedding: np.ndarray) -> np.ndarray:
        """float32 ``[N, K]`` adapted logits (log-probabilities): what the predictor returns."""
        return self.log_probabilities(raw_logits, embedding).astype(np.float32)

    def to_dict(self) -> dict[str, Any]:
        return {
            "method": self.method,
            "class_ids": list(self.classes),
            "weights": [[round(float(v), 7) for v in row] for row in self.weights],
            "bias": [round(float(v), 7) for v in self.bias],
            "base_temperature": float(self.base_temperature),
            "unlabelled_discount": [round(float(v), 7) for v in self.discount],
            "features": FEATURES,
        }


def read_head(metadata: Mapping[str, Any], k: int, d: int, path: str | os.PathLike) -> Head | None:
    """The head stored in a model's parsed metadata, or None when it has none.

    Raises:
        ValueError: naming ``path`` when the ``adaptation`` prop does not hold a valid head for
            ``k`` classes and ``d`` embedding dimensions.
    """
    block = metadata.get(METADATA_KEY)
    if block is None:
        return None
    try:
        head = block["head"]
        classes = [int(c) for c in head["class_ids"]]
        w = np.asarray(head["weights"], dtype=np.float64)
        b = np.asarray(head["bias"], dtype=np.float64)
        t = float(head["base_temperature"])
        # models adapted before the discount rule existed kept unlabelled classes exactly
        rho = np.asarray(head.get("unlabelled_discount", [1.0] * k), dtype=np.float64)
        problem = None
        if not classes or sorted(set(classes)) != classes or not 0 <= classes[0] <= classes[-1] < k:
            problem = f"class_ids {classes} are not sorted distinct ids in [0, {k})"
        elif w.shape != (len(classes), (d or w.shape[1] - len(classes)) + len(classes)):
            problem = f"weights have shape {w.shape}, expected [{len(classes)}, D + {len(classes)}]"
        elif b.shape != (len(classes),) or not (np.isfinite(w).all() and np.isfinite(b).all()):
            problem = "bias has the wrong length, or the head holds NaN or inf"
        elif not (math.isfinite(t) and t > 0):
            problem = f"base_temperature {t} is not a positive number"
        elif rho.shape != (k,) or not ((rho > 0) & (rho <= 1)).all():
            problem = f"unlabelled_discount {rho.tolist()} is not {k} factors in (0, 1]"
    except (TypeError, KeyError, ValueError) as exc:
        problem = f"unreadable head ({type(exc).__name__}: {exc})"
    if problem:
        raise ValueError(
            f"{path}: metadata {METADATA_KEY}: {problem}; adapt the base model again with "
            "`local-damage adapt`"
        )
    return Head(str(head.get("method", "?")), classes, w, b, t, k, rho)


def adaptation_summary(metadata: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """The ``adaptation`` block of a model's metadata without the head's weights (for model
    cards), or None when the model was not adapted."""
    block = (metadata or {}).get(METADATA_KEY)
    if not isinstance(block, Mapping):
        return None
    out = {k: v for k, v in block.items() if k != "head"}
    head = block.get("head")
    if isinstance(head, Mapping):
        out["base_temperature"] = head.get("base_temperature")
    return out
