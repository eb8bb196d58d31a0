"""`score-batch --resume`: the results of the scenes an earlier batch into the same folder
finished, so a resumed summary covers every scene, done before or now (no torch).

A scene whose outputs all exist is not scored again. Its report comes from the earlier summaries
in the output folder (``summary.json`` and the shards' ``summary-<i>-of-<n>.json``) when one
holds it for the same vector file and was written after that file; otherwise it is read back
from the scene's vector output (:func:`report_from_outputs`: buildings, per-class counts, not
covered, skipped, and the alignment and order check from the file's metadata).
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: Summary of a batch (``summary-<i>-of-<n>.json`` for a shard).
BATCH_SUMMARY = "summary.json"
#: Where a done scene's report was read: the earlier summary or its outputs.
FROM_SUMMARY, FROM_OUTPUTS = "summary", "outputs"
#: Output metadata keys the report is read back from (:mod:`app.scoring.common`).
_METADATA = {"local_damage_alignment": "alignment", "local_damage_order": "order"}


def summary_path(out_dir: str | os.PathLike, shard: tuple[int, int] | None) -> Path:
    """``summary.json``, or ``summary-<i>-of-<n>.json`` for a shard (shards share a folder)."""
    if shard is None:
        return Path(out_dir) / BATCH_SUMMARY
    return Path(out_dir) / f"summary-{shard[0]}-of-{shard[1]}.json"


def earlier_reports(out_dir: str | os.PathLike) -> dict[str, tuple[dict, float]]:
    """Scene name -> (its report, the summary file's modification time) from every earlier
    summary in ``out_dir`` (the newest summary wins); a summary that cannot be read is left out
    with a log line."""
    found: dict[str, tuple[dict, float]] = {}
    paths = sorted(Path(out_dir).glob("summary*.json"), key=lambda p: p.stat().st_mtime)
    for path in paths:
        try:
            data = json.loads(path.read_text())
            scenes = data["scenes"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.warning("%s: not read for --resume (%s); done scenes are read from their outputs",
                        path, exc)  # fmt: skip
            continue
        mtime = path.stat().st_mtime
        for scene in scenes if isinstance(scenes, list) else []:
            if isinstance(scene, dict) and isinstance(scene.get("report"), dict):
                found[str(scene.get("name"))] = (scene["report"], mtime)
    return found


def report_from_outputs(
    paths: Mapping[str, Path], name: str, class_names: Sequence[str]
) -> dict | None:
    """A done scene's report read back from its vector output; None when it cannot be read.

    Holds what the file records: ``buildings``, ``scored``, ``per_class``, ``not_covered``,
    ``skipped`` (the buildings whose status is ``skipped: <reason>``), ``outputs``, and the
    ``alignment`` and ``order`` check from the file's metadata; ``seconds`` is None (not
    recorded).
    """
    from pyogrio.errors import DataLayerError, DataSourceError
    from pyogrio.raw import read

    vector = paths["vector"]
    try:
        meta, _, _, values = read(str(vector), read_geometry=False, columns=["damage", "status"])
    except (DataSourceError, DataLayerError, RuntimeError, ValueError, OSError) as exc:
        log.warning("%s: cannot be read back for the summary (%s)", vector, exc)
        return None
    columns = dict(zip(meta["fields"], values, strict=True))
    if "status" not in columns or "damage" not in columns:
        log.warning("%s: has no damage and status columns to read back for the summary", vector)
        return None
    status = ["" if s is None else str(s) for s in columns["status"]]
    damage = Counter(
        str(d) for d, s in zip(columns["damage"], status, strict=True) if s == "scored"
    )
    report = {
        "scene": name,
        "buildings": len(status),
        "scored": sum(damage.values()),
        "per_class": {c: damage.get(c, 0) for c in class_names},
        "not_covered": sum(s == "not_covered" for s in status),
        "skipped": [
            {"item": f"{vector} feature {i}", "reason": s.split(":", 1)[-1].strip()}
            for i, s in enumerate(status)
            if s.startswith("skipped")
        ],
        "outputs": {k: str(v) for k, v in paths.items()},
        "seconds": None,
    }
    report.update(_metadata(vector, meta))
    return report


def _metadata(vector: Path, meta: Mapping) -> dict:
    """The alignment and order check recorded in a vector output (GeoJSON collection members,
    GeoPackage layer metadata)."""
    out: dict = {}
    if vector.suffix.lower() == ".gpkg":
        from pyogrio import read_info

        stored = read_info(str(vector)).get("layer_metadata") or {}
        for key, name in _METADATA.items():
            if key in stored:
                out[name] = json.loads(stored[key])
        return out
    try:
        data = json.loads(vector.read_text())
    except (OSError, ValueError):
        return out
    for key, name in _METADATA.items():
        if key in data:
            out[name] = data[key]
    return out


def done_report(
    name: str,
    paths: Mapping[str, Path],
    earlier: Mapping[str, tuple[dict, float]],
    class_names: Sequence[str],
) -> tuple[dict | None, str | None]:
    """``(report, where)`` of a scene an earlier run finished: the earlier summary's when it
    names the same vector file and was written after it, else read back from the outputs."""
    vector = paths["vector"]
    if name in earlier:
        report, written = earlier[name]
        same = (report.get("outputs") or {}).get("vector") == str(vector)
        if same and written >= vector.stat().st_mtime:
            return report, FROM_SUMMARY
    report = report_from_outputs(paths, name, class_names)
    return report, None if report is None else FROM_OUTPUTS
