"""The fine-tuning arm shared by the few-shot (``bench fewshot``) and new-tile (``bench new-tile``)
reports: the network fine-tuned on some labelled buildings exactly as ``adapt --finetune`` /
``--semi`` does it, and its predictions for other buildings. Importing it does not import torch
(the ``bench`` commands are registered by every ``local-damage`` call)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from local_damage.adapt.finetune import FinetuneOptions, finetune, input_size
from local_damage.adapt.network import predict


def finetune_labels(weights: Path, b, given, unlabelled, options: FinetuneOptions):
    """The network fine-tuned on the labels ``given`` of ``b`` as ``adapt --finetune`` does it
    (with the ``unlabelled`` buildings, FixMatch as ``adapt --semi``).

    Raises:
        FinetuneError: fine-tuning refuses the labels.
    """
    return finetune(
        weights,
        b.pre[given],
        b.post[given],
        b.labels[given],
        options,
        None if unlabelled is None else b.pre[unlabelled],
        None if unlabelled is None else b.post[unlabelled],
    )


def finetuned_classes(r, b, rows) -> np.ndarray:
    """The classes the fine-tuned network ``r`` predicts for the buildings ``rows`` of ``b``."""
    logits = predict(r.net, b.pre[rows], b.post[rows], input_size(r.config, b.pre.shape[1]))
    return logits.argmax(1)
