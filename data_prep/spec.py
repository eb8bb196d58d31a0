"""The chip specification and damage classes shared by data preparation, training and serving."""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: Damage classes in label order (xBD joint damage scale).
CLASS_NAMES: tuple[str, ...] = ("no-damage", "minor-damage", "major-damage", "destroyed")
#: Label value stored for buildings without a damage label.
UNLABELLED = -1
#: xBD subtype of buildings the annotators could not grade.
UNCLASSIFIED = "un-classified"


@dataclass(frozen=True)
class ChipSpec:
    """How a building chip is cut from a pre/post image pair.

    A square window centred on the footprint centroid with side
    ``max(min_size, context * longest bbox side)`` pixels of the source (pre) grid, read
    boundless with zero fill beyond the image, then resampled to ``chip_size`` x ``chip_size``.

    Attributes:
        chip_size: side of the stored chip in pixels.
        context: window side as a multiple of the footprint's longest bbox side.
        min_size: smallest window side in source pixels (small buildings get this much context).
    """

    chip_size: int = 128
    context: float = 2.0
    min_size: int = 64

    def __post_init__(self) -> None:
        if self.chip_size < 8:
            raise ValueError(f"chip_size must be at least 8 pixels, got {self.chip_size}")
        if self.context <= 0:
            raise ValueError(f"context must be positive, got {self.context}")
        if self.min_size < 1:
            raise ValueError(f"min_size must be at least 1 pixel, got {self.min_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ChipSpec:
        known = {k: d[k] for k in ("chip_size", "context", "min_size") if k in d}
        return cls(
            chip_size=int(known.get("chip_size", cls.chip_size)),
            context=float(known.get("context", cls.context)),
            min_size=int(known.get("min_size", cls.min_size)),
        )


def parse_label(value: object) -> int | None:
    """Map a damage label given as a class name or 0-3 to its class id.

    Returns None for an empty value and for ``un-classified``; raises ValueError for anything else
    that is not a known class.
    """
    if value is None:
        return None
    if isinstance(value, float) and value != value:  # NaN from pandas/GeoPandas
        return None
    text = str(value).strip().lower()
    if text in ("", UNCLASSIFIED, "none", "nan"):
        return None
    if text in CLASS_NAMES:
        return CLASS_NAMES.index(text)
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and number.is_integer() and 0 <= int(number) < len(CLASS_NAMES):
        return int(number)
    raise ValueError(
        f"unknown damage label {value!r}: expected one of {', '.join(CLASS_NAMES)} or 0-{len(CLASS_NAMES) - 1}"
    )
