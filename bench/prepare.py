"""`local-damage bench prepare`: xBD chip extraction rate against the decode-only rate.

For each worker count the same run measures (1) decode-only: every tile's pre and post image
decoded once with the reader `prepare xbd` uses and nothing else, on the same workers (one Dask
job per tile; one worker runs in this process); (2) extraction: the whole `prepare xbd` into a temporary chip store. Both are reported in
buildings per second over the same buildings, so their ratio is the share of time spent outside
decoding (1.0 = chip cutting and writing cost nothing).
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from data_prep.engine import Engine, open_client
from data_prep.spec import ChipSpec
from data_prep.text_table import Column, text_table
from data_prep.xbd import XbdOptions, prepare_xbd, run_tiles, worker_setup
from data_prep.xbd_tiles import find_tiles, read_tile_image

#: Targets the figures are held to: extraction at least this share of the decode-only rate on
#: one worker, and at least this speedup of extraction with two workers over one.
TARGET_RATIO = 0.70
TARGET_SPEEDUP = 2 * 0.9


def _load_average() -> list[float] | None:
    """1-, 5- and 15-minute load averages (None where the platform has none)."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def _checks(results: list[dict]) -> dict:
    """Whether the figures meet :data:`TARGET_RATIO` and :data:`TARGET_SPEEDUP` (None when the
    worker count a target is about was not measured)."""
    by_workers = {r["workers"]: r for r in results}
    one, two = by_workers.get(1), by_workers.get(2)
    return {
        "target_ratio_one_worker": TARGET_RATIO,
        "ratio_one_worker": None if one is None else one["ratio"],
        "ratio_one_worker_met": None if one is None else one["ratio"] >= TARGET_RATIO,
        "target_speedup_two_workers": TARGET_SPEEDUP,
        "speedup_two_workers": None if one is None or two is None else two["speedup"],
        "speedup_two_workers_met": (
            None if one is None or two is None else two["speedup"] >= TARGET_SPEEDUP
        ),
    }


def _decode_tile(paths: tuple) -> int:
    """Decode a tile's images with the `prepare xbd` reader and nothing else; returns how many."""
    worker_setup()  # the process set up as for a `prepare xbd` job
    decoded = 0
    for path in paths:
        try:
            read_tile_image(path)
            decoded += 1
        except Exception:  # extraction skips unreadable images too
            pass
    return decoded


def _warm_up(_) -> None:
    """Import what a tile job needs, once per worker process, before anything is timed
    (:mod:`data_prep.xbd` comes with this module)."""
    import cv2  # noqa: F401
    import rasterio  # noqa: F401
    import shapely  # noqa: F401


def _process_cpu_seconds(_=None) -> float:
    """CPU seconds (user + system) used so far by the calling process."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_seconds(client=None) -> float:
    """CPU seconds used by this process, plus those of the cluster's worker processes."""
    try:
        total = _process_cpu_seconds()
    except ImportError:  # not on Unix: this process only
        return time.process_time()
    if client is not None:
        total += sum(client.run(_process_cpu_seconds).values())
    return total


def _warm_cache(paths: Sequence[Path]) -> None:
    """Read every file's bytes once so that both measurements start from the page cache."""
    for path in paths:
        with open(path, "rb") as fh:
            while fh.read(1 << 22):
                pass


def bench_prepare(
    roots: Sequence[str | os.PathLike] | str | os.PathLike,
    spec: ChipSpec | None = None,
    workers: Sequence[int] = (1, 2),
    limit: int | None = None,
    as_json: bool = False,
    repeat: int = 3,
    print_result: bool = True,
) -> dict:
    """Measure buildings per second for xBD chip extraction next to the decode-only rate.

    Args:
        roots: xBD root folder(s).
        spec: chip specification (default ``ChipSpec()``).
        workers: worker counts to measure, in order.
        limit: use only the first ``limit`` tiles (sorted by name).
        as_json: print the figures as JSON instead of a table.
        repeat: runs per measurement; the fastest counts (both rates alike).
        print_result: print the figures (to stdout).

    Returns:
        ``{"tiles", "buildings", "spec", "reader", "cpu_count", "results": [...]}`` where each
        result holds ``workers``, ``decode_s``, ``extract_s`` (seconds),
        ``decode_buildings_per_s``, ``extract_buildings_per_s``, ``ratio`` (extraction over
        decode-only rate), ``speedup`` (extraction rate over that of one worker, or of the
        first worker count when one worker is not measured) and
        ``decode_cpu_s``, ``extract_cpu_s``, ``cpu_ratio``: the same in CPU seconds of all
        processes, which other load on the machine disturbs less than wall time. ``checks``
        holds the targets and whether they are met (``ratio_one_worker_met``,
        ``speedup_two_workers_met``; None when that worker count was not measured), and
        ``load_average`` the machine's load before and after (figures taken under load are
        not comparable).

    Raises:
        XbdRootError: a root does not exist or holds no xBD tiles.
    """
    spec = spec or ChipSpec()
    roots = [roots] if isinstance(roots, (str, os.PathLike)) else list(roots)
    tiles, _ = find_tiles(roots)
    if limit is not None:
        tiles = tiles[: max(int(limit), 0)]
    images = [p for t in tiles for p in (t.pre, t.post) if p is not None]
    _warm_cache(images)
    load_before = _load_average()

    results = []
    buildings = 0
    per_tile = [tuple(p for p in (t.pre, t.post) if p is not None) for t in tiles]
    for w in workers:
        decode_s = extract_s = decode_cpu = extract_cpu = float("inf")
        # one cluster per worker count, started (and warmed up) before any timing, so that both
        # measurements see the same running workers
        with open_client(w) as client:
            engine = Engine(workers=w, client=client)
            if client is not None:
                run_tiles(_warm_up, [None] * (2 * w), engine, progress=False)
            for _ in range(max(int(repeat), 1)):  # alternate, so both see the same conditions
                cpu = _cpu_seconds(client)  # asked before the clock starts (an RPC)
                start = time.perf_counter()
                run_tiles(_decode_tile, per_tile, engine, progress=False)
                decode_s = min(decode_s, time.perf_counter() - start)
                decode_cpu = min(decode_cpu, _cpu_seconds(client) - cpu)
                with tempfile.TemporaryDirectory(prefix="bench-prepare-") as tmp:
                    cpu = _cpu_seconds(client)
                    start = time.perf_counter()
                    report = prepare_xbd(
                        roots,
                        Path(tmp) / "chips",
                        spec=spec,
                        options=XbdOptions(limit=limit),
                        engine=engine,
                        progress=False,
                    )
                    extract_s = min(extract_s, time.perf_counter() - start)
                    extract_cpu = min(extract_cpu, _cpu_seconds(client) - cpu)
        buildings = report.chips
        # seconds to the microsecond: a synthetic run decodes in a few milliseconds, and the
        # rates and ratios a script recomputes from them must agree to well under 1 %
        results.append(
            {
                "workers": int(w),
                "decode_s": round(decode_s, 6),
                "extract_s": round(extract_s, 6),
                "decode_buildings_per_s": round(buildings / decode_s, 1),
                "extract_buildings_per_s": round(buildings / extract_s, 1),
                "ratio": round(decode_s / extract_s, 3),
                "decode_cpu_s": round(decode_cpu, 6),
                "extract_cpu_s": round(extract_cpu, 6),
                "cpu_ratio": round(decode_cpu / extract_cpu, 3) if extract_cpu > 0 else 0.0,
            }
        )
    one = [r for r in results if r["workers"] == 1]
    base = (one or results)[0]["extract_buildings_per_s"] if results else 0.0
    for r in results:
        r["speedup"] = round(r["extract_buildings_per_s"] / base, 3) if base > 0 else 0.0
    figures = {
        "tiles": len(tiles),
        "images": len(images),
        "buildings": buildings,
        "spec": spec.to_dict(),
        "reader": "rasterio (GDAL) for PNG and GeoTIFF",
        "cpu_count": os.cpu_count(),
        "repeat": max(int(repeat), 1),
        "load_average": {"before": load_before, "after": _load_average()},
        "results": results,
        "checks": _checks(results),
    }
    if print_result:
        print(json.dumps(figures, indent=2) if as_json else format_table(figures))
    return figures


#: The table's columns, over the results of ``bench_prepare``.
_COLUMNS = [
    Column("workers", "workers", width=7),
    Column("decode-only bldg/s", "decode_buildings_per_s", ".1f", width=18),
    Column("extraction bldg/s", "extract_buildings_per_s", ".1f", width=17),
    Column("ratio", "ratio", ".2f", width=5),
    Column("speedup", "speedup", ".2f", width=7),
    Column("cpu ratio", "cpu_ratio", ".2f", width=9),
]


def format_table(figures: dict) -> str:
    """The figures of ``bench_prepare`` as a plain-text table."""
    spec = figures["spec"]
    lines = [
        f"xBD chip extraction: {figures['tiles']} tiles, {figures['images']} images, "
        f"{figures['buildings']} buildings; chip {spec['chip_size']} px, context {spec['context']}, "
        f"min {spec['min_size']} px; reader {figures['reader']}; {figures['cpu_count']} CPUs; "
        f"best of {figures['repeat']} run(s)",
        *text_table(_COLUMNS, figures["results"], "  "),
    ]
    lines.append(
        f"ratio = extraction rate / decode-only rate at the same worker count (target >= "
        f"{TARGET_RATIO:.2f} on one worker); speedup = extraction rate / that of one worker "
        f"(target >= {TARGET_SPEEDUP:.1f} with two); cpu ratio = the ratio in CPU seconds (less "
        "disturbed by other load)"
    )
    load = figures.get("load_average") or {}
    if load.get("before") is not None:
        lines.append(
            f"load average (1/5/15 min) before {load['before']}, after {load['after']} on "
            f"{figures['cpu_count']} CPUs"
        )
    return "\n".join(lines)
