"""Options shared by the commands, so one concept has one flag everywhere.

- ``--xbd ROOT``: an xBD root (``images/`` and ``labels/``); ``--root`` is accepted as its alias.
- ``--model MODEL``: a damage model, by file or by the name of a bundled model (``default``), as
  ``--localizer`` takes a localiser (``localizer``); :func:`resolve_models` turns names into
  files for every command. ``--chips CHIPS`` / ``--fold K``: a chip store and one of its folds;
  ``--out``: where results go.
- ``--json`` (print the result as JSON, a switch) and ``--quiet`` (no progress bars, warnings
  only) on every command that reports.
- ``--seed N`` and ``--batch-size N``: one spelling and one help form, "what it is (default N)",
  each command keeping its own default.
- ``comma_list(kind)``: the argparse type of every comma-separated list (``--labels 10,20``).
- ``--max-pixels``, ``--align``, ``--workers`` / ``--scheduler`` and the chip spec, each with
  one help text.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import TypeVar

from data_prep.alignment import ALIGN_MODES, AUTO, MIN_CORRECT_PX
from data_prep.engine import SCHEDULER_ENV, Engine
from data_prep.errors import UsageError
from data_prep.quality import MAX_PIXELS, MAX_PIXELS_ENV, max_pixels
from data_prep.spec import ChipSpec
from runtime.grading import check_cost
from runtime.registry import resolve_model

#: What ``--model`` takes, said once for every command's help.
MODEL_CHOICE = "a bundled model's name (default) or an .onnx file from `local-damage export`"
#: What ``--localizer`` takes.
LOCALIZER_CHOICE = (
    "a bundled localiser's name (localizer) or an .onnx file from `local-damage localize export`"
)


def cost_type(text: str) -> float:
    """A false-alarm cost on the command line (:func:`runtime.grading.check_cost`)."""
    try:
        return check_cost(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    d = ChipSpec()
    parser.add_argument(
        "--chip-size",
        type=int,
        default=d.chip_size,
        metavar="N",
        help=f"side of the stored chips in pixels (default {d.chip_size})",
    )
    parser.add_argument(
        "--context",
        type=float,
        default=d.context,
        metavar="F",
        help=f"window side as a multiple of the footprint's longest bbox side (default {d.context})",
    )
    parser.add_argument(
        "--min-size",
        type=int,
        default=d.min_size,
        metavar="PX",
        help=f"smallest window side in source pixels (default {d.min_size})",
    )
    parser.add_argument(
        "--strict", action="store_true", help="exit non-zero when any input was skipped"
    )


def _pixel_count(text: str) -> int:
    try:
        value = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number of pixels, got {text}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be positive, got {text}")
    return value


def align_argument(parser: argparse.ArgumentParser) -> None:
    """Add ``--align`` (shared by `prepare scene`, `score` and `score-batch`)."""

    parser.add_argument(
        "--align",
        choices=ALIGN_MODES,
        default=AUTO,
        help="auto (default): measure the post-to-pre shift (phase correlation in blocks of the "
        f"pre grid) and, when it is confident and longer than {MIN_CORRECT_PX:g} px, correct the "
        "post imagery before chips are cut; the shift is reported either way. off: use the post "
        "imagery as given",
    )


def max_pixels_argument(parser: argparse.ArgumentParser, default: int | None = None) -> None:
    """Add ``--max-pixels`` (shared by `prepare`, `score`, `score-batch` and `app`)."""

    parser.add_argument(
        "--max-pixels",
        type=_pixel_count,
        metavar="N",
        help="refuse, before decoding, any image, internal block or read window of more pixels "
        f"(default: ${MAX_PIXELS_ENV}, else {default or MAX_PIXELS:_})",
    )


def resolve_max_pixels(args: argparse.Namespace) -> int:
    """The pixel limit of a command.

    Raises:
        UsageError: the environment's limit is unusable.
    """
    try:
        return max_pixels(args.max_pixels)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc


def add_engine_arguments(parser: argparse.ArgumentParser, jobs: str) -> None:
    """``--workers`` and ``--scheduler`` (:mod:`data_prep.engine`); ``jobs`` names the unit."""

    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        metavar="N",
        help=f"worker processes of the embedded Dask cluster, one job per {jobs} (default: one "
        "per CPU core; 1 runs in this process)",
    )
    parser.add_argument(
        "--scheduler",
        metavar="ADDRESS",
        help=f"run on an existing Dask cluster, e.g. tcp://host:8786 (default: ${SCHEDULER_ENV} "
        "when set, else the embedded cluster); its workers must see the same paths",
    )


def engine_of(args: argparse.Namespace) -> Engine:
    """The :class:`data_prep.engine.Engine` of :func:`add_engine_arguments`' options."""
    return Engine(workers=args.workers, scheduler=args.scheduler)


def add_xbd_args(
    parser: argparse.ArgumentParser,
    required: bool = True,
    repeatable: bool = False,
    help: str = "xBD root: images/ and labels/ (or its split folders)",
    group=None,
) -> None:
    """``--xbd ROOT`` (alias ``--root``, the earlier name in `prepare`, `localize` and
    `evaluate xview2`): one xBD root, or with ``repeatable`` one per use (``args.xbd`` a list)."""
    (group or parser).add_argument(
        "--xbd",
        "--root",
        dest="xbd",
        metavar="ROOT",
        required=required,
        action="append" if repeatable else "store",
        help=help + (" (repeatable)" if repeatable else "") + "; --root is the same",
    )


def add_model_args(
    parser: argparse.ArgumentParser,
    required: bool = False,
    help: str = f"damage model: {MODEL_CHOICE} (default: the bundled default)",
    group=None,
) -> None:
    """``--model MODEL``: a damage model, by file or by bundled name (:func:`resolve_models`)."""
    (group or parser).add_argument("--model", metavar="MODEL", required=required, help=help)


def add_localizer_args(
    parser: argparse.ArgumentParser,
    help: str = f"building localiser: {LOCALIZER_CHOICE}",
) -> None:
    """``--localizer LOCALIZER``: a building localiser, by file or by bundled name."""
    parser.add_argument("--localizer", metavar="LOCALIZER", help=help)


#: Arguments that name a model, and what each holds (for the message when it is not found).
MODEL_ARGUMENTS = {"model": "model", "localizer": "localiser model"}


def resolve_models(args: argparse.Namespace) -> None:
    """Turn the ``--model`` and ``--localizer`` of any command into files, in place: a path that
    exists stays as given, a bundled model's name (``default``, ``localizer``) becomes its file
    (:func:`runtime.registry.resolve_model`), from any working folder.

    Raises:
        ModelError: a value that is neither a file nor a model name (the message lists the names).
    """
    for attr, kind in MODEL_ARGUMENTS.items():
        value = getattr(args, attr, None)
        if isinstance(value, str) and value:
            setattr(args, attr, str(resolve_model(value, kind)))


def add_chips_args(
    parser: argparse.ArgumentParser,
    required: bool = True,
    fold: bool = True,
    fold_help: str = "use fold K of CHIPS/splits.csv",
    group=None,
) -> None:
    """``--chips CHIPS`` (a chip store of `local-damage prepare`) and, with ``fold``, ``--fold K``."""
    (group or parser).add_argument(
        "--chips",
        metavar="CHIPS",
        required=required,
        help="chip store folder (`local-damage prepare`)",
    )
    if fold:
        parser.add_argument("--fold", type=int, metavar="K", help=fold_help)


def add_output_args(
    parser: argparse.ArgumentParser,
    required: bool = True,
    metavar: str = "DIR",
    help: str = "output folder",
) -> None:
    """``--out``: where the command writes its results."""
    parser.add_argument("--out", metavar=metavar, required=required, help=help)


def add_json_switch(
    parser: argparse.ArgumentParser, help: str = "print the result as JSON"
) -> None:
    """``--json``, a switch: the result as JSON on standard output instead of the table."""
    parser.add_argument("--json", action="store_true", help=help)


def add_report_args(parser: argparse.ArgumentParser, json: bool = True, quiet: bool = True) -> None:
    """``--json`` (the result as JSON on standard output) and ``--quiet`` (no progress bars;
    only warnings and errors on standard error)."""
    if json:
        add_json_switch(parser)
    if quiet:
        parser.add_argument(
            "--quiet", action="store_true", help="no progress bars; only warnings and errors"
        )


def _with_default(help: str) -> str:
    """``help`` followed by the option's default, as every shared option says it."""
    return help.replace("%", "%%") + " (default %(default)s)"


def add_seed_arg(
    parser: argparse.ArgumentParser, default: int = 0, help: str = "random seed"
) -> None:
    """``--seed N``; ``help`` says what it seeds, the default is appended."""
    parser.add_argument("--seed", type=int, default=default, help=_with_default(help))


def add_batch_size_arg(
    parser: argparse.ArgumentParser,
    default: int,
    help: str,
    kind: Callable[[str], int] = int,
    metavar: str | None = "N",
) -> None:
    """``--batch-size N``; ``help`` says what a batch holds, the default is appended; ``kind``
    checks the value (e.g. positive only), ``metavar`` None keeps argparse's own name."""
    parser.add_argument(
        "--batch-size", type=kind, default=default, metavar=metavar, help=_with_default(help)
    )


T = TypeVar("T")


def comma_list(
    kind: Callable[[str], T] = str,
    what: str = "values",
    example: str = "a,b",
    at_least: float | None = None,
    choices: Sequence[str] | None = None,
    spaces: bool = False,
    empty: Sequence[T] | None = None,
) -> Callable[[str], list[T]]:
    """The argparse type of a comma-separated list, e.g. ``type=comma_list(int, "counts")``.

    Items are stripped and blank ones skipped (``10, 20,`` is ``[10, 20]``); with ``spaces``,
    spaces separate items too (``"10 20"``). Each item goes through ``kind``: a ``ValueError``
    is reported as "give comma-separated WHAT, e.g. EXAMPLE", an ``ArgumentTypeError`` as it
    is. ``at_least`` is the smallest value allowed, ``choices`` the items allowed; a list with
    no item gives ``empty`` as a list, or is refused when ``empty`` is None.
    """

    def parse(text: str) -> list[T]:
        parts = text.replace(",", " ").split() if spaces else text.split(",")
        items = [part.strip() for part in parts if part.strip()]
        wrong = f"give comma-separated {what}, e.g. {example}; got {text!r}"
        if choices is not None and any(item not in choices for item in items):
            raise argparse.ArgumentTypeError(
                f"give comma-separated {what} of {', '.join(choices)}; got {text!r}"
            )
        try:
            values = [kind(item) for item in items]
        except ValueError:
            raise argparse.ArgumentTypeError(wrong) from None
        if not values:
            if empty is None:
                raise argparse.ArgumentTypeError(wrong)
            return list(empty)
        if at_least is not None and min(values) < at_least:  # type: ignore[operator]
            raise argparse.ArgumentTypeError(
                f"{what} must each be at least {at_least:g}, got {text!r}"
            )
        return values

    return parse
