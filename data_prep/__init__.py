"""Imagery to chip pairs: xBD tiles and georeferenced scenes to per-building pre/post chips.

Nothing in this package imports torch; serving code reuses it to cut chips exactly as training did.
"""

from data_prep.spec import CLASS_NAMES, ChipSpec

__all__ = ["CLASS_NAMES", "ChipSpec"]
