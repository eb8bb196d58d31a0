"""FixMatch on the event's unlabelled buildings, joined to fine-tuning on the analyst's labels
(``adapt --semi``; Sohn et al. 2020, as google-research/skai trains on a new event's unlabelled
examples).

In every step of :func:`local_damage.adapt.finetune.train_top`, a batch of unlabelled pairs (a
few per labelled pair) is graded in a weak view, a random turn or mirror of the pair (the same for
pre and post); a grade given with probability at least the confidence threshold (0.95) becomes a
pseudo-label, and the network is trained to give it to a strong view of the same pair: another
turn or mirror, brightness, contrast and noise changed on each image apart (two acquisitions),
and one square cut out of both at the same place. The loss is the mean over the batch of the
masked cross-entropy (a pair below the threshold adds 0), weighted by ``unlabelled_weight``.

The frozen part of the network runs once: on all 8 turns of each unlabelled pair (the weak views)
and on :data:`STRONG_VIEWS` strong views of it drawn at the start, so a step is a pass of the
trained top only. At most :data:`MAX_UNLABELLED` unlabelled pairs are used (a seeded random draw).
"""

from __future__ import annotations

import numpy as np

from local_damage.adapt.network import dihedral, logits_of, prepare_chips, trunk_features

#: Strong views drawn per unlabelled pair.
STRONG_VIEWS = 2
#: Unlabelled pairs used at most.
MAX_UNLABELLED = 400
#: Side of the square cut out of a strong view, as a share of the chip side.
CUTOUT = 0.35


def strong_view(x_pre, x_post, gen):
    """A strong view of normalised NCHW pairs: a random turn or mirror (the same for both),
    brightness, contrast and Gaussian noise per image, and a square cut out of both at the same
    place (filled with 0, the mean)."""
    import torch

    n, _, h, w = x_pre.shape
    out = []
    turns = torch.randint(0, 8, (n,), generator=gen)
    for x in (x_pre, x_post):
        x = torch.stack([dihedral(x[i : i + 1], int(turns[i]))[0] for i in range(n)])
        scale = 1 + 0.4 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5)
        shift = 0.4 * (torch.rand(n, 1, 1, 1, generator=gen) - 0.5)
        noise = 0.1 * torch.randn(x.shape, generator=gen)
        out.append(x * scale + shift + noise)
    side = max(1, int(CUTOUT * h))
    for i in range(n):
        r = int(torch.randint(0, h - side + 1, (1,), generator=gen))
        c = int(torch.randint(0, w - side + 1, (1,), generator=gen))
        for x in out:
            x[i, :, r : r + side, c : c + side] = 0.0
    return out[0], out[1]


class Unlabelled:
    """The event's unlabelled pairs, as cached frozen features of weak and strong views.

    Args:
        trunk: the frozen part of the network.
        pre, post: uint8 ``[U, S, S, 3]`` chips.
        size: the network's input side.
        seed: seed of the draw and of the strong views.
    """

    def __init__(self, trunk, pre: np.ndarray, post: np.ndarray, size: int, seed: int = 0) -> None:
        import torch

        rng = np.random.default_rng(seed)
        if len(pre) > MAX_UNLABELLED:
            pick = np.sort(rng.choice(len(pre), MAX_UNLABELLED, replace=False))
            pre, post = pre[pick], post[pick]
        self.n = len(pre)
        x_pre, x_post = prepare_chips(pre, size), prepare_chips(post, size)
        self.weak = trunk_features(trunk, x_pre, x_post)
        gen = torch.Generator().manual_seed(int(seed))
        views = []
        with torch.no_grad():
            for _ in range(STRONG_VIEWS):
                s_pre, s_post = strong_view(x_pre, x_post, gen)
                views.append(torch.stack([trunk(s_pre), trunk(s_post)]))
        self.strong = torch.stack(views)

    def loss(self, net, top, m: int, gen, confidence: float):
        """``(loss, share of the m pairs whose pseudo-label passed the threshold)``."""
        import torch
        import torch.nn.functional as F

        idx = torch.randint(0, self.n, (m,), generator=gen)
        turn = torch.randint(0, self.weak.shape[0], (m,), generator=gen)
        view = torch.randint(0, self.strong.shape[0], (m,), generator=gen)
        with torch.no_grad():
            weak = logits_of(net, top, self.weak[turn, 0, idx], self.weak[turn, 1, idx])
            p = torch.softmax(weak, dim=1)
            conf, pseudo = p.max(dim=1)
            mask = (conf >= confidence).float()
        strong = logits_of(net, top, self.strong[view, 0, idx], self.strong[view, 1, idx])
        loss = (F.cross_entropy(strong, pseudo, reduction="none") * mask).mean()
        return loss, float(mask.mean())
