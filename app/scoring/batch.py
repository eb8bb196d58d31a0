"""Batch scoring: many scenes with one loaded model, one set of outputs per scene.

Scenes are listed in a CSV or as scene folders (:func:`read_scene_list`); each is scored by
:func:`app.scoring.scene.score_scene`. A batch is resumable (finished scenes are left alone) and can be
split into shards for several machines (:func:`shard_of`, a stable hash of the scene name). A
scene that fails is recorded and the batch goes on; the summary lists it at the end. A resumed
batch's summary covers the scenes finished before too (:mod:`app.scoring.batch_resume`).
"""

from __future__ import annotations

import csv
import hashlib
import logging
import os
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

from app.scoring.batch_resume import BATCH_SUMMARY, done_report, earlier_reports, summary_path
from app.scoring.common import RASTER_SUFFIXES, ScoreOptions
from app.scoring.detect import score_scene_detected
from app.scoring.outputs import FORMAT_SUFFIX, OutputError
from app.scoring.scene import score_scene
from app.scoring.writer import OutputPaths
from data_prep.engine import (
    Bar,
    Engine,
    JobFailed,
    describe,
    map_jobs,
    scheduler_address,
    threads_per_worker,
)
from data_prep.errors import LocalDamageError
from data_prep.mosaic import SceneError
from data_prep.report import Skipped
from data_prep.store import safe_name, write_json
from runtime.familiarity import ADVICE
from runtime.localizer import Localizer
from runtime.predictor import Predictor

log = logging.getLogger(__name__)

#: Footprint file suffixes recognised in scene folders.
FOOTPRINT_SUFFIXES = (".geojson", ".json", ".gpkg", ".shp", ".fgb")
__all__ = ["BATCH_SUMMARY", "summary_path"]  # re-exported from app.scoring.batch_resume


class BatchError(LocalDamageError, ValueError):
    """A batch option that cannot be used; the message names it and says what is accepted."""


@dataclass(frozen=True)
class SceneJob:
    """One scene of a batch: its name (the output file stem) and input files (``buildings``
    None: no footprints, the localiser finds the buildings; :mod:`app.scoring.detect`)."""

    name: str
    pre: tuple[str, ...]
    post: tuple[str, ...]
    buildings: str | None


def _split_paths(text: str, base: Path) -> tuple[str, ...]:
    out = []
    for part in (text or "").split(";"):
        part = part.strip()
        if part:
            p = Path(part).expanduser()
            out.append(str(p if p.is_absolute() else base / p))
    return tuple(out)


def read_scene_list(source: str | os.PathLike) -> tuple[list[SceneJob], list[Skipped]]:
    """The scenes of a batch from a CSV file or a folder of scene folders.

    CSV: columns ``pre``, ``post``, ``buildings`` (several files separated by ``;``; relative
    paths are resolved against the CSV's folder; ``buildings`` empty: the localiser finds the
    buildings) and optionally ``name``. Without a name, a scene is named after its footprint
    file's stem (without footprints, its first pre file's), or, when stems repeat, its path below
    the CSV's folder (``folder/stem``) or else its last folder and stem.

    Folder: every sub-folder is a scene named after it, holding ``pre/*.tif``, ``post/*.tif``
    and one footprint file (``.geojson``, ``.json``, ``.gpkg``, ``.shp`` or ``.fgb``) or none
    (the localiser finds the buildings).

    Returns:
        ``(scenes, problems)``: usable scene entries in input order, and entries that cannot be
        used (a missing field, a folder without imagery or footprints, a repeated name) with the
        reason.

    Raises:
        SceneError: the source does not exist, a CSV lacks a required column, or a folder holds
            no scene folders.
    """
    source = Path(source)
    if not source.exists():
        raise SceneError(source, "scene list not found (a CSV file or a folder of scene folders)")
    problems: list[Skipped] = []
    entries: list[tuple[str | None, SceneJob | None, str]] = []  # (name, job, item)
    if source.is_dir():
        folders = sorted(p for p in source.iterdir() if p.is_dir() and not p.name.startswith("."))
        if not folders:
            raise SceneError(
                source,
                "holds no scene folders; expected DIR/<scene>/pre/*.tif, DIR/<scene>/post/*.tif "
                "and one footprint file in DIR/<scene>/",
            )
        for folder in folders:
            pre = _rasters(folder / "pre")
            post = _rasters(folder / "post")
            prints = sorted(
                p
                for p in folder.iterdir()
                if p.is_file() and p.suffix.lower() in FOOTPRINT_SUFFIXES
            )
            missing = [k for k, v in (("pre/*.tif", pre), ("post/*.tif", post)) if not v]
            if missing:
                problems.append(
                    Skipped(str(folder), f"no {' or '.join(missing)} in the scene folder")
                )
                continue
            if len(prints) > 1:
                found = ", ".join(p.name for p in prints)
                problems.append(
                    Skipped(
                        str(folder),
                        f"needs one footprint file ({', '.join(FOOTPRINT_SUFFIXES)}) or none "
                        f"(buildings detected), found {found}",
                    )
                )
                continue
            job = SceneJob(folder.name, pre, post, str(prints[0]) if prints else None)
            entries.append((job.name, job, str(folder)))
    else:
        with open(source, newline="", encoding="utf-8-sig") as fh:
            reader = csv.DictReader(fh)
            header = {(h or "").strip().lower(): h for h in reader.fieldnames or []}
            need = [c for c in ("pre", "post", "buildings") if c not in header]
            if need:
                raise SceneError(
                    source,
                    f"missing column(s) {', '.join(need)}; a scene CSV needs pre, post, buildings "
                    "(and optionally name); found: " + (", ".join(header) or "no header"),
                )
            rows = []
            for line, row in enumerate(reader, start=2):
                get = {k: (row.get(h) or "").strip() for k, h in header.items()}
                if not any(get.values()):
                    continue
                item = f"{source} line {line}"
                pre = _split_paths(get["pre"], source.parent)
                post = _split_paths(get["post"], source.parent)
                bld = _split_paths(get["buildings"], source.parent)
                missing = [k for k, v in (("pre", pre), ("post", post)) if not v]
                if missing or len(bld) > 1:
                    reason = (
                        f"empty {', '.join(missing)}"
                        if missing
                        else "give one footprint file in buildings (or none to detect them)"
                    )
                    problems.append(Skipped(item, reason))
                    continue
                rows.append((item, get.get("name", ""), pre, post, bld[0] if bld else None))
        # without footprints a scene is named after its first pre file
        stems = Counter(Path(r[4] or r[2][0]).stem for r in rows)
        for item, given, pre, post, found in rows:
            bld = found or pre[0]
            if given:
                scene = given
            elif stems[Path(bld).stem] == 1:
                scene = Path(bld).stem
            else:
                try:
                    rel = Path(bld).resolve().relative_to(source.parent.resolve())
                except ValueError:
                    rel = Path(*Path(bld).parts[-2:])
                scene = str(rel.with_suffix(""))
            entries.append((scene, SceneJob(scene, pre, post, found), item))

    jobs: list[SceneJob] = []
    seen: dict[str, str] = {}
    for scene, job, item in entries:
        key = safe_name(scene).lower()
        if key in seen:
            problems.append(
                Skipped(
                    item,
                    f"scene name {scene!r} gives the same output file as {seen[key]}; "
                    "give each scene its own name (the CSV's name column)",
                )
            )
            continue
        seen[key] = item
        jobs.append(job)
    return jobs, problems


def _rasters(folder: Path) -> tuple[str, ...]:
    if not folder.is_dir():
        return ()
    return tuple(
        str(p)
        for p in sorted(folder.iterdir())
        if p.is_file() and p.suffix.lower() in RASTER_SUFFIXES
    )


def parse_shard(text: str) -> tuple[int, int]:
    """``"I/N"`` -> (I, N) with 1 <= I <= N.

    Raises:
        BatchError: for anything else.
    """
    try:
        i_text, n_text = text.split("/")
        i, n = int(i_text), int(n_text)
    except ValueError:
        raise BatchError(f"--shard {text!r}: expected I/N, e.g. 1/4 (shards 1 to N)") from None
    if n < 1 or not 1 <= i <= n:
        raise BatchError(f"--shard {text!r}: shards are numbered 1 to N, with N >= 1")
    return i, n


def shard_of(name: str, n: int) -> int:
    """The shard (1..n) a scene belongs to: a stable hash of its name, the same on any machine."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % n + 1


@dataclass(frozen=True)
class BatchPlan:
    """What a batch writes for each scene, and which of its scenes it scores.

    Attributes:
        fmt: ``"geojson"`` or ``"gpkg"``: each scene's per-building output.
        raster: also write each scene's class raster (``<scene>.tif``).
        overlay: also write each scene's overlay PNG (``<scene>.png``).
        web_map: also write each scene's web map (``<scene>.html``, :mod:`app.scoring.webmap`).
        resume: skip scenes whose outputs all exist.
        shard: ``(i, n)``: score only the scenes with :func:`shard_of` ``== i``.
    """

    fmt: str = "geojson"
    raster: bool = False
    overlay: bool = False
    web_map: bool = False
    resume: bool = False
    shard: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.fmt not in FORMAT_SUFFIX:
            raise OutputError(f"unknown format {self.fmt!r}; use geojson or gpkg")

    def outputs(self, out_dir: str | os.PathLike, name: str) -> dict[str, Path]:
        """Output paths of one scene of the batch: kind -> path."""
        out_dir, stem = Path(out_dir), safe_name(name)
        paths = {"vector": out_dir / f"{stem}{FORMAT_SUFFIX[self.fmt]}"}
        if self.raster:
            paths["raster"] = out_dir / f"{stem}.tif"
        if self.overlay:
            paths["overlay"] = out_dir / f"{stem}.png"
        if self.web_map:
            paths["map"] = out_dir / f"{stem}.html"
        return paths

    def mine(self, name: str) -> bool:
        """Whether this batch (its shard) scores the scene ``name``."""
        return self.shard is None or shard_of(name, self.shard[1]) == self.shard[0]


def _absolute(job: SceneJob) -> SceneJob:
    """``job`` with absolute input paths: a Dask worker may run in another working directory."""

    def absolute(paths: Iterable[str]) -> tuple[str, ...]:
        return tuple(str(Path(p).absolute()) for p in paths)

    buildings = None if job.buildings is None else str(Path(job.buildings).absolute())
    return SceneJob(job.name, absolute(job.pre), absolute(job.post), buildings)


def _remove_stale_temporaries(paths: Iterable[Path]) -> None:
    """Delete temporary files an interrupted run left for these outputs (``.<name>.*``)."""
    for path in paths:
        for tmp in path.parent.glob(f".{path.name}.*"):
            tmp.unlink(missing_ok=True)


@dataclass
class BatchReport:
    """Outcome of a batch: one entry per scene, plus list problems."""

    scenes: list[dict] = field(default_factory=list)
    problems: list[Skipped] = field(default_factory=list)
    shard: tuple[int, int] | None = None
    seconds: float = 0.0

    def count(self, status: str) -> int:
        return sum(1 for s in self.scenes if s["status"] == status)

    @property
    def succeeded(self) -> int:
        return self.count("scored") + self.count("done")

    def to_dict(self) -> dict:
        buildings = sum((s.get("report") or {}).get("buildings", 0) for s in self.scenes)
        return {
            "shard": None if self.shard is None else f"{self.shard[0]}/{self.shard[1]}",
            "scenes": self.scenes,
            "problems": [{"item": s.item, "reason": s.reason} for s in self.problems],
            "totals": {
                "scenes": len(self.scenes),
                "scored": self.count("scored"),
                "done_before": self.count("done"),
                "failed": self.count("failed"),
                "problems": len(self.problems),
                "buildings": buildings,
                "seconds": round(self.seconds, 3),
            },
        }

    def summary(self) -> str:
        head = f"scenes: {len(self.scenes)}"
        if self.shard:
            head += f" in shard {self.shard[0]}/{self.shard[1]}"
        lines = [
            f"{head}; scored {self.count('scored')}, already done {self.count('done')}, "
            f"failed {self.count('failed')} in {self.seconds:.1f} s"
        ]
        per_class: Counter = Counter()
        for s in self.scenes:
            per_class.update((s.get("report") or {}).get("per_class", {}))
        if per_class:
            lines.append(
                "buildings per class: " + ", ".join(f"{k} {v}" for k, v in per_class.items())
            )
        for s in self.scenes:
            order = (s.get("report") or {}).get("order") or {}
            if order.get("reversed"):
                lines.append(f"warning: scene {s['name']}: {order.get('warning', '')}")
        unfamiliar = [
            s["name"]
            for s in self.scenes
            if ((s.get("report") or {}).get("familiarity") or {}).get("unfamiliar")
        ]
        if unfamiliar:
            lines.append(
                f"grades uncertain on the imagery of {len(unfamiliar)} scene(s), unlike what the "
                f"model learnt from: {', '.join(unfamiliar)}; {ADVICE}"
            )
        failed = [s for s in self.scenes if s["status"] == "failed"]
        if failed or self.problems:
            lines.append(f"problems ({len(failed) + len(self.problems)}):")
            lines.extend(f"  - {p}" for p in self.problems)
            lines.extend(f"  - scene {s['name']}: {s['error']}" for s in failed)
        return "\n".join(lines)

    def exit_code(self) -> int:
        """0 when some scene succeeded (or there was nothing to do), 1 when none did."""
        if self.succeeded or (not self.scenes and not self.problems):
            return 0
        return 1


@dataclass(frozen=True)
class _SceneTask:
    """One scene to score: its inputs, output paths and the scoring options."""

    job: SceneJob
    paths: dict[str, Path]
    options: ScoreOptions


@dataclass(frozen=True)
class _Models:
    """What a worker needs to load the models itself: their files, providers and threads."""

    model: str
    providers: tuple[str, ...]
    threads: int | None
    localizer: str | None
    tta: str = "none"


#: Models loaded in this (worker) process, by :class:`_Models`: each is loaded once.
_LOADED: dict[_Models, tuple] = {}


def _score_on_worker(task: _SceneTask, models: _Models) -> dict:
    """A Dask job: score one scene with models loaded once per worker process."""
    if models not in _LOADED:
        predictor = Predictor(
            models.model, providers=models.providers, threads=models.threads, tta=models.tta
        )
        localizer = None
        if models.localizer is not None:
            localizer = Localizer(models.localizer, threads=models.threads)
        _LOADED.clear()
        _LOADED[models] = (predictor, localizer)
    predictor, localizer = _LOADED[models]
    return _score_task(task, predictor, localizer, progress=False)


def _score_task(task: _SceneTask, predictor, localizer, progress: bool) -> dict:
    """Score one scene; ``{"status": "scored", "report": ...}`` or ``{"status": "failed",
    "error": ...}`` (a bad scene never raises). Temporaries of an earlier, interrupted attempt
    are removed first; outputs are renamed into place only when complete."""
    job, paths = task.job, task.paths
    _remove_stale_temporaries(paths.values())
    options = replace(task.options, progress=progress)
    outputs = OutputPaths(
        paths["vector"], paths.get("raster"), paths.get("overlay"), paths.get("map")
    )
    try:
        if job.buildings is None:  # no footprints: the localiser finds the buildings
            result = score_scene_detected(
                predictor,
                job.pre,
                job.post,
                outputs,
                localizer=localizer,
                name=job.name,
                options=options,
            )
        else:
            result = score_scene(
                predictor,
                job.pre,
                job.post,
                job.buildings,
                outputs,
                name=job.name,
                options=options,
            )
    except (SceneError, OutputError, OSError) as exc:
        return {"status": "failed", "error": str(exc)}
    except Exception as exc:  # a bad scene must not stop the batch
        return {"status": "failed", "error": f"{type(exc).__name__}: {exc}"}
    return {"status": "scored", "report": result.to_dict()}


def score_batch(
    predictor: Predictor,
    scenes: Sequence[SceneJob],
    out_dir: str | os.PathLike,
    plan: BatchPlan | None = None,
    *,
    options: ScoreOptions | None = None,
    localizer=None,
    engine: Engine | None = None,
    problems: Sequence[Skipped] = (),
) -> BatchReport:
    """Score many scenes with one loaded model, one set of outputs per scene.

    A scene that fails is recorded and the batch goes on. With ``plan.resume``, a scene whose outputs
    all exist is left alone (outputs are renamed into place only when complete and the vector
    file is written last, so an existing file is a finished one) and keeps its report in the
    summary, from the earlier summary or read back from its outputs
    (:mod:`app.scoring.batch_resume`); temporary files an interrupted run left behind are
    removed before a scene is scored again.

    Args:
        predictor: the loaded ONNX model.
        scenes: scenes to score (from :func:`read_scene_list`).
        out_dir: output folder (``<scene>.geojson``/``.gpkg``, ``.tif``, ``.png``, ``.html``).
        plan: the outputs of each scene, ``resume`` and ``shard`` (:class:`BatchPlan`; default:
            GeoJSON only, every scene).
        options: how every scene is scored (:class:`app.scoring.common.ScoreOptions`: batch
            size, block size, pixel limit, alignment; each scene's report records its shift);
            ``options.progress`` shows progress bars over scenes and buildings.
        localizer: the :class:`runtime.localizer.Localizer` that finds the buildings of scenes
            without footprints (default: the bundled one; none available: those scenes fail
            with a message saying how to get one).
        engine: where the scenes run (:class:`data_prep.engine.Engine`; default: in this
            process). ``workers``: worker processes of the embedded Dask cluster, one job per
            scene, each loading the model once (None: one per core; never more than there are
            scenes to score); 1 scores in this process with ``predictor``. ``scheduler``: an
            existing Dask scheduler (else ``$DASK_SCHEDULER_ADDRESS``), whose workers load the
            model from ``predictor.path`` and must see the inputs and ``out_dir`` at the same
            paths. ``client``: a ``distributed.Client`` to run on as it is.
        problems: scene-list entries that could not be used, carried into the summary.

    Returns:
        The batch report; it is also written to :func:`summary_path` and printed by the CLI.
    """
    options, plan, engine = options or ScoreOptions(), plan or BatchPlan(), engine or Engine()
    progress = options.progress
    start = time.perf_counter()
    out_dir = Path(out_dir).absolute()  # workers may run in another working directory
    out_dir.mkdir(parents=True, exist_ok=True)
    mine = [s for s in scenes if plan.mine(s.name)]
    report = BatchReport(problems=list(problems), shard=plan.shard)
    entries: list[dict] = []
    todo: list[_SceneTask] = []
    for job in mine:
        paths = plan.outputs(out_dir, job.name)
        entry: dict = {"name": job.name, "outputs": {k: str(v) for k, v in paths.items()}}
        entries.append(entry)
        if plan.resume and all(p.is_file() for p in paths.values()):
            entry["status"] = "done"
        else:
            todo.append(_SceneTask(_absolute(job), paths, options))
    by_name = {e["name"]: e for e in entries}
    if any(e.get("status") == "done" for e in entries):
        _done_reports(entries, out_dir, plan, predictor.class_names)
    try:
        results = _run_tasks(todo, predictor, localizer, progress, engine)
    except BaseException:
        # interrupted (Ctrl-C, SIGTERM) or the cluster failed: the jobs' workers are gone, and
        # what they left half-written goes too; finished outputs stay for --resume
        for task in todo:
            _remove_stale_temporaries(task.paths.values())
        raise
    for task, result in zip(todo, results, strict=True):
        if isinstance(result, JobFailed):
            result = {"status": "failed", "error": result.error}
        by_name[task.job.name].update(result)
    report.scenes.extend(entries)
    report.seconds = time.perf_counter() - start
    write_json(summary_path(out_dir, plan.shard), report.to_dict())
    return report


def _done_reports(entries, out_dir, plan: BatchPlan, class_names) -> None:
    """Give each scene an earlier run finished its report (``report_from``: ``summary`` or
    ``outputs``; :func:`app.scoring.batch_resume.done_report`)."""
    earlier = earlier_reports(out_dir)
    for entry in entries:
        if entry.get("status") == "done":
            paths = plan.outputs(out_dir, entry["name"])
            report, where = done_report(entry["name"], paths, earlier, class_names)
            if report is not None:
                entry["report"], entry["report_from"] = report, where


def _run_tasks(todo, predictor, localizer, progress, engine: Engine) -> list:
    """The results of :func:`_score_task` over ``todo``: here, or as Dask jobs."""
    workers = engine.worker_count(len(todo))
    with engine.open(len(todo)) as cluster:
        if cluster is None:  # in this process, with the loaded models and per-scene bars
            results = map_jobs(
                lambda task: _score_task(task, predictor, localizer, progress),
                todo,
                bar=Bar("scenes", "scene", progress and len(todo) > 1),
            )
        else:
            if progress:
                log.info("scoring %d scene(s) %s", len(todo), describe(cluster))
            models = _Models(
                str(Path(predictor.path).absolute()),
                tuple(predictor.providers),
                None if scheduler_address(engine.scheduler) else threads_per_worker(workers),
                None if localizer is None else str(Path(localizer.path).absolute()),
                getattr(predictor, "tta", "none"),
            )
            results = map_jobs(
                partial(_score_on_worker, models=models),
                todo,
                client=cluster,
                keys=[t.job.name for t in todo],
                bar=Bar("scenes", "scene", progress),
            )
    return results
