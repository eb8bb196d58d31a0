"""Feature correlation of pre/post pairs: ``W [f_pre, f_post]`` and the latent hierarchical module.

The paper (Sec. 3.4) correlates a pre and a post feature of dimension ``d`` with a matrix
``W in R^{d x 2d}`` applied to their concatenation, and in practice fixes ``W = [I, -I]``: the
difference ``f_pre - f_post``. :class:`Correlation` is that operation, fixed (a subtraction, no
parameters) or learnable (``W`` initialised to ``[I, -I]``), for vectors ``[B, d]`` and for maps
``[B, d, h, w]`` (where a learnable ``W`` is a 1x1 convolution).

:class:`LatentCorrelation` is the latent hierarchical feature correlation module: the correlation
of each selected encoder block, every map brought to one ``latent_size x latent_size`` grid
(average pooling to shrink, bilinear up-sampling to enlarge), concatenated over channels, averaged
over channels into one map, flattened and L2-normalised into ``l``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

#: The encoder blocks of the paper (ResNet ``layer1`` .. ``layer4``).
BLOCKS = (1, 2, 3, 4)
#: Index of block 1 in the smp feature list (index 0 is the input, 1 the stride-2 stem).
FIRST_BLOCK_FEATURE = 2


def parse_blocks(spec: str | Iterable[int] | None) -> tuple[int, ...]:
    """Parse a block selection such as ``"1-2-3-4"``, ``"3-4"`` or ``"4"``.

    Args:
        spec: Block numbers 1..4 joined by ``-`` (commas and spaces are accepted too), an
            iterable of ints, or ``None``/``""`` for no latent module.

    Returns:
        Sorted unique block numbers; empty when the latent module is disabled.

    Raises:
        ValueError: A part is not an integer in 1..4, or is repeated.
    """
    if spec is None:
        return ()
    if isinstance(spec, str):
        parts = [p for p in spec.replace(",", "-").replace(" ", "-").split("-") if p]
        try:
            blocks = [int(p) for p in parts]
        except ValueError as err:
            raise ValueError(
                f"latent blocks {spec!r}: expected block numbers 1-4 joined by '-', e.g. '1-2-3-4'"
            ) from err
    else:
        blocks = [int(b) for b in spec]
    bad = [b for b in blocks if b not in BLOCKS]
    if bad:
        raise ValueError(f"latent blocks {spec!r}: blocks must be in {BLOCKS}, got {bad}")
    if len(set(blocks)) != len(blocks):
        raise ValueError(f"latent blocks {spec!r}: a block is repeated")
    return tuple(sorted(blocks))


def format_blocks(blocks: Sequence[int]) -> str:
    """Inverse of :func:`parse_blocks`: ``(1, 2, 3, 4) -> "1-2-3-4"``, ``() -> ""``."""
    return "-".join(str(b) for b in blocks)


def _pooling_matrix(n: int, out: int, dtype: torch.dtype, device) -> torch.Tensor:
    """``[out, n]``: row ``i`` averages the inputs ``floor(i n / out)`` to ``ceil((i + 1) n / out)``
    (exclusive), the bins of ``adaptive_avg_pool`` along one side."""
    matrix = torch.zeros(out, n, dtype=dtype, device=device)
    for i in range(out):
        start, stop = (i * n) // out, -(-((i + 1) * n) // out)
        matrix[i, start:stop] = 1.0 / (stop - start)
    return matrix


def resize_map(x: torch.Tensor, size: int) -> torch.Tensor:
    """Bring a map ``[B, C, h, w]`` to ``[B, C, size, size]``.

    Larger maps are average-pooled (a plain ``avg_pool2d`` when the side is a multiple of
    ``size``; otherwise adaptive average pooling written as products with averaging matrices,
    because ONNX has no adaptive pooling to sizes that do not divide the input: an input size
    such as 96 px, whose block-2 map is 12 px, could be trained but not exported), smaller ones
    bilinearly up-sampled (``align_corners=False``), equal ones returned as they are. A map larger
    along one side and smaller along the other is pooled, then up-sampled.
    """
    h, w = int(x.shape[-2]), int(x.shape[-1])
    if h > size or w > size:
        th, tw = min(h, size), min(w, size)
        if h % th == 0 and w % tw == 0:
            x = F.avg_pool2d(x, kernel_size=(h // th, w // tw))
        else:  # adaptive pooling as two products with averaging matrices (ONNX: MatMul)
            rows = _pooling_matrix(h, th, x.dtype, x.device)
            cols = _pooling_matrix(w, tw, x.dtype, x.device)
            x = torch.matmul(torch.matmul(rows, x), cols.transpose(0, 1))
        h, w = th, tw
    if h < size or w < size:
        x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False)
    return x


class Correlation(nn.Module):
    """``W [a, b]`` with ``W = [I, -I]`` fixed (``a - b``) or learnable.

    Args:
        dim: Feature dimension ``d`` of ``a`` and ``b`` (channels for maps).
        learnable: Learn ``W in R^{d x 2d}`` (initialised to ``[I, -I]``) instead of subtracting.

    Shapes:
        ``a``, ``b``: ``[B, d]`` or ``[B, d, h, w]``; output the same shape.
    """

    def __init__(self, dim: int, learnable: bool = False) -> None:
        super().__init__()
        if dim < 1:
            raise ValueError(f"correlation dimension must be >= 1, got {dim}")
        self.dim = dim
        self.learnable = learnable
        if learnable:
            eye = torch.eye(dim)
            self.weight = nn.Parameter(torch.cat([eye, -eye], dim=1))  # [d, 2d]
        else:
            self.register_parameter("weight", None)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        if self.weight is None:
            return a - b
        pair = torch.cat([a, b], dim=1)
        if pair.dim() == 2:
            return F.linear(pair, self.weight)
        return F.conv2d(pair, self.weight[:, :, None, None])

    def extra_repr(self) -> str:
        return f"dim={self.dim}, learnable={self.learnable}"


class LatentCorrelation(nn.Module):
    """The latent hierarchical feature correlation module (``Lat`` in the paper).

    Args:
        channels: Channels of the 6 encoder feature maps (``encoder.out_channels``).
        blocks: Selected blocks (1..4), e.g. ``parse_blocks("1-2-3-4")``; not empty.
        latent_size: Side ``S`` of the common grid; ``l`` has ``D_L = S * S`` entries.
        learnable: Learnable ``W_i`` per block (1x1 convolutions from ``2 d_i`` to ``d_i``
            channels initialised to ``[I, -I]``) instead of the fixed difference.
        absolute: Average ``|W_i [f_pre, f_post]|`` over channels instead of the signed
            correlation (the paper's reading): signed differences of opposite sign in different
            channels cancel in the mean, absolute ones add up. Every entry of the map is then
            ``>= 0``, so every inner product ``<l_i, l_n>`` is ``>= 0`` and the absolute value
            that OCL puts on negatives changes nothing: OCL on such an ``l`` is SCL on it
            (unless ``centre`` is set).
        centre: Subtract each map's mean over its ``S x S`` positions before ``l`` is
            L2-normalised (``l = normalize(m - mean(m))``), so that ``l`` lies in the subspace
            orthogonal to the all-ones vector: inner products of ``l`` take both signs and
            OCL can push negatives to perpendicular from both sides. The map returned for
            display (``latent_map``, the change map) is not centred.

    With the fixed ``W_i`` the channel mean is taken per block before resizing (``mean_c(f_pre -
    f_post)`` resized, weighted by ``d_i``): the same map as resizing and concatenating every
    channel and then averaging, because resizing acts on each channel linearly, at a fraction of
    the cost.
    """

    def __init__(
        self,
        channels: Sequence[int],
        blocks: Sequence[int],
        latent_size: int = 8,
        learnable: bool = False,
        absolute: bool = False,
        centre: bool = False,
    ) -> None:
        super().__init__()
        blocks = parse_blocks(blocks)
        if not blocks:
            raise ValueError("the latent correlation module needs at least one block")
        if latent_size < 1:
            raise ValueError(f"latent_size must be >= 1, got {latent_size}")
        if len(channels) < FIRST_BLOCK_FEATURE + len(BLOCKS):
            raise ValueError(
                f"encoder gives {len(channels)} feature maps; blocks 1-4 need "
                f"{FIRST_BLOCK_FEATURE + len(BLOCKS)}"
            )
        self.blocks = blocks
        self.latent_size = latent_size
        self.learnable = learnable
        self.absolute = absolute
        self.centre = centre
        self.feature_index = [FIRST_BLOCK_FEATURE + b - 1 for b in blocks]
        dims = [int(channels[i]) for i in self.feature_index]
        total = sum(dims)
        self.register_buffer(
            "block_weight", torch.tensor([d / total for d in dims]), persistent=False
        )
        self.correlations = nn.ModuleList(Correlation(d, learnable) for d in dims)

    @property
    def dim(self) -> int:
        """``D_L``, the length of ``l``."""
        return self.latent_size * self.latent_size

    def latent_map(self, pre: Sequence[torch.Tensor], post: Sequence[torch.Tensor]) -> torch.Tensor:
        """The channel-averaged hierarchical correlation map.

        Args:
            pre: Encoder feature maps of the pre images (all 6, as the encoder returns them).
            post: The same for the post images.

        Returns:
            ``[B, 1, S, S]``: mean over all channels of the selected blocks of
            ``W_i [f_pre, f_post]``, each block resized to ``S x S``; it is large where the
            features changed (signed: positive where pre activations exceed post ones).
        """
        out = None
        for k, (i, corr) in enumerate(zip(self.feature_index, self.correlations, strict=True)):
            if corr.learnable or self.absolute:
                diff = corr(pre[i], post[i])
                m = (diff.abs() if self.absolute else diff).mean(dim=1, keepdim=True)
            else:
                m = pre[i].mean(dim=1, keepdim=True) - post[i].mean(dim=1, keepdim=True)
            m = resize_map(m, self.latent_size) * self.block_weight[k]
            out = m if out is None else out + m
        return out

    def forward(
        self, pre: Sequence[torch.Tensor], post: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(l, latent_map)``: ``l`` ``[B, S*S]`` unit norm and the map ``[B, 1, S, S]``.

        ``l`` is the flattened map, centred over its positions when ``centre`` is set, then
        L2-normalised (a map that is constant over its positions gives ``l = 0`` when centred).
        """
        m = self.latent_map(pre, post)
        flat = m.flatten(1)
        if self.centre:
            flat = flat - flat.mean(dim=1, keepdim=True)
        return F.normalize(flat, dim=1), m

    def extra_repr(self) -> str:
        return (
            f"blocks={format_blocks(self.blocks)!r}, latent_size={self.latent_size}, "
            f"learnable={self.learnable}, absolute={self.absolute}, centre={self.centre}"
        )
