"""`local-damage bench train --chips N ...`: training at xBD scale, simulated.

A chip store of ``N`` chips (xBD has some 850,000 buildings) is simulated without ``N`` chips'
worth of disk: :data:`UNIQUE_SHARDS` shards of :data:`PER_SHARD` chips each are written (chips
drawn from a source store, by default one prepared from :mod:`data_prep.synthetic`'s seeded xBD
tiles, each turned or mirrored at random), and every tile of the simulated store is a hard link
to one of them, so the store has ``N / PER_SHARD`` tiles and ``N`` manifest rows like a real one
while its disk holds only the unique shards. The shards are read as the trainer reads any store
(:class:`data_prep.store.ChipReader`); the unique shards stay in the page cache, so the figures
are those of a store on a fast disk or in the page cache, not of a cold disk.

For each store size the same run measures, with the training configuration (default
``configs/default.yaml``, ``data.num_workers`` loader workers):

- **loader alone**: batches of the training loader (:func:`local_damage.train.loaders.build_loaders`:
  random draw, augmentation, resize) drawn as fast as they come, chips per second;
- **training step**: :func:`local_damage.train.epoch.train_step` on one batch already in
  memory, chips per second;
- **loop**: the loader feeding the step, as training runs, chips per second;

and the memory while the loader runs alone: the peak resident memory of the training process and
of the largest loader worker, sampled every :data:`SAMPLE_S` s, and how much their sum grew from
the first sample to the last; then the training process's peak with the model training. Each
store is measured in a fresh process (flat memory: no growth with the chips read, and no more at 200,000 chips than at 2,000
beyond the manifest). This module is imported by the CLI parser: torch is imported inside
functions only.
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import numpy as np

from data_prep.errors import UsageError
from data_prep.spec import CLASS_NAMES, ChipSpec
from data_prep.store import (
    MANIFEST_COLUMNS,
    SHARDS,
    ChipReader,
    read_manifest,
    read_meta,
    start_store,
    write_manifest,
)
from data_prep.synthetic import make_xbd
from data_prep.xbd import prepare_xbd

#: Chips per simulated tile (an xBD tile holds some 40 to 100 buildings).
PER_SHARD = 100
#: Unique shards written; every tile links to one of them.
UNIQUE_SHARDS = 40
#: Default store sizes.
DEFAULT_CHIPS = (2_000, 200_000)
#: Goal: the loader at least this many times the training step's chips per second.
LOADER_GOAL = 3.0
#: Most timed training steps (and loop steps) per store.
MAX_STEPS = 8
#: Fewest batches a store must give: the warm-up, one timed batch and two loop steps.
MIN_BATCHES = 4
#: Seconds between two memory samples.
SAMPLE_S = 0.1


def _source_chips(source: Path | None, work: Path, count: int, chip_size: int, seed: int):
    """``count`` (pre, post, label) chips drawn from the store ``source`` (None: one prepared
    from the synthetic xBD tiles under ``work``), each turned or mirrored at random."""
    if source is None:
        source = work / "source"
        if not (source / "manifest.csv").exists():
            make_xbd(work / "xbd", seed=seed, n_tiles=6)
            prepare_xbd([work / "xbd"], source, spec=ChipSpec(chip_size=chip_size))
    frame = read_manifest(source)
    frame = frame[frame["label"] >= 0].reset_index(drop=True)
    if frame.empty:
        raise ValueError(f"{source}: no labelled chips to repeat")
    reader = ChipReader(source)
    rng = np.random.default_rng(seed)
    rows = frame.to_dict("records")
    pre, post, labels = [], [], []
    for k in rng.integers(0, len(rows), count):
        a, b = reader.pair(rows[k])
        turn, flip = int(rng.integers(0, 4)), bool(rng.integers(0, 2))
        a, b = np.rot90(a, turn), np.rot90(b, turn)
        if flip:
            a, b = a[:, ::-1], b[:, ::-1]
        pre.append(np.ascontiguousarray(a))
        post.append(np.ascontiguousarray(b))
        labels.append(int(rows[k]["label"]))
    return np.stack(pre), np.stack(post), np.asarray(labels)


def make_sim_store(
    root: str | os.PathLike,
    chips: int,
    source: str | os.PathLike | None = None,
    chip_size: int = 128,
    seed: int = 0,
) -> Path:
    """A simulated chip store of ``chips`` chips under ``root`` (made once; its
    ``store.json`` records the size): :data:`UNIQUE_SHARDS` shards written, every tile a hard
    link to one of them. Returns the store's folder."""
    root = Path(root)
    store = root / f"store{chips}"
    meta = read_meta(store) if (store / "manifest.csv").exists() else {}
    if meta.get("simulated", {}).get("chips") == chips:
        return store
    unique = root / "unique"
    if not (unique / f"u{UNIQUE_SHARDS - 1:03d}_post.npy").exists():
        unique.mkdir(parents=True, exist_ok=True)
        pre, post, labels = _source_chips(
            None if source is None else Path(source),
            root,
            UNIQUE_SHARDS * PER_SHARD,
            chip_size,
            seed,
        )
        for j in range(UNIQUE_SHARDS):
            part = slice(j * PER_SHARD, (j + 1) * PER_SHARD)
            np.save(unique / f"u{j:03d}_pre.npy", pre[part])
            np.save(unique / f"u{j:03d}_post.npy", post[part])
        np.save(unique / "labels.npy", labels)
    labels = np.load(unique / "labels.npy")
    if store.exists():
        shutil.rmtree(store)
    start_store(store)
    rows = []
    for t in range(math.ceil(chips / PER_SHARD)):
        j = t % UNIQUE_SHARDS
        files = {}
        for kind in ("pre", "post"):
            rel = f"{SHARDS}/t{t:06d}_{kind}.npy"
            os.link(unique / f"u{j:03d}_{kind}.npy", store / rel)
            files[kind] = rel
        for i in range(min(PER_SHARD, chips - t * PER_SHARD)):
            label = int(labels[j * PER_SHARD + i])
            row = dict.fromkeys(MANIFEST_COLUMNS, "")
            row.update(
                chip_id=f"t{t:06d}:{i}",
                event=f"event{t % 19:02d}",
                tile=f"t{t:06d}",
                uid=str(i),
                label=label,
                label_name=CLASS_NAMES[label],
                pre_file=files["pre"],
                post_file=files["post"],
                index=i,
            )
            rows.append(row)
    meta = {"chip_spec": {"chip_size": chip_size}, "simulated": {"chips": chips}}
    write_manifest(store, rows, meta)
    return store


class MemorySampler:
    """Samples, every :data:`SAMPLE_S` seconds in a thread, the resident memory of this process
    and of each of its child processes (the loader workers)."""

    def __init__(self) -> None:
        import psutil

        self.me = psutil.Process()
        self.main_mb = 0.0
        self.worker_mb = 0.0
        self.totals: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        import psutil

        main = self.me.memory_info().rss / 2**20
        workers = []
        for child in self.me.children(recursive=True):
            try:
                workers.append(child.memory_info().rss / 2**20)
            except psutil.Error:
                continue
        self.main_mb = max(self.main_mb, main)
        self.worker_mb = max([self.worker_mb, *workers])
        self.totals.append(main + sum(workers))

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def __enter__(self) -> MemorySampler:
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def figures(self) -> dict[str, float]:
        return {
            "main_rss_mb": round(self.main_mb, 1),
            "worker_rss_mb": round(self.worker_mb, 1),
            "growth_mb": round(self.totals[-1] - self.totals[0], 1),
        }


def measure_store(
    store: Path,
    config: str | None,
    workers: int,
    batches: int,
    device: str = "cpu",
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The loader alone, the training step alone and the two together on one store (the step
    on ``device``: ``cpu`` or ``cuda``, where ``train.amp: auto`` trains in mixed precision),
    with the config's ``overrides`` (``KEY=VALUE``) applied."""
    import torch

    from local_damage.config import load_yaml
    from local_damage.train.config import Config
    from local_damage.train.distributed import DistInfo
    from local_damage.train.epoch import train_step
    from local_damage.train.loaders import build_loaders
    from local_damage.train.loop import build_learner

    cfg = load_yaml(Config, config, [*overrides, f"data.num_workers={workers}"])
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ids = read_manifest(store)["chip_id"].tolist()
    loader = build_loaders(cfg, store, ids, [], DistInfo(), device).train
    batch = cfg.train.batch_size
    # one pass over the store feeds the warm-up, the timed batches and the loop
    batches = max(min(batches, len(loader) - 1 - MAX_STEPS), 1)
    out: dict[str, Any] = {
        "chips": len(ids),
        "timed_batches": batches,
        "batch_size": batch,
        "workers": workers,
        "device": device.type,
    }
    it = iter(loader)
    first = next(it)  # starts the workers
    with MemorySampler() as memory:
        start = time.perf_counter()
        for _ in range(batches):
            next(it)
        loader_s = time.perf_counter() - start
    with MemorySampler() as training:
        learner = build_learner(cfg, loader.dataset.labels, device, DistInfo())
        alpha = cfg.loss.alpha(0)
        pre, post, y = first
        train_step(learner, cfg, pre, post, y, alpha)  # warm-up
        sync()
        steps = min(max(batches // 10, 2), MAX_STEPS)
        start = time.perf_counter()
        for _ in range(steps):
            train_step(learner, cfg, pre, post, y, alpha)
        sync()
        step_s = time.perf_counter() - start
        start = time.perf_counter()
        for _ in range(steps):
            pre, post, y = next(it)
            train_step(learner, cfg, pre, post, y, alpha)
        sync()
        loop_s = time.perf_counter() - start
    del it
    out.update(
        loader_chips_per_s=round(batches * batch / loader_s, 1),
        step_chips_per_s=round(steps * batch / step_s, 1),
        loop_chips_per_s=round(steps * batch / loop_s, 1),
        threads=torch.get_num_threads(),
        **memory.figures(),
        train_rss_mb=training.figures()["main_rss_mb"],
    )
    out["loader_over_step"] = round(out["loader_chips_per_s"] / out["step_chips_per_s"], 2)
    out["goal_met"] = bool(out["loader_over_step"] >= LOADER_GOAL)
    return out


def platform_start_method() -> None:
    """Give a spawned measuring process the platform's default start method (fork on Linux).

    A process started by ``spawn`` keeps ``spawn`` as its own default, so its loader workers
    would be spawned too, where `local-damage train` forks them: spawned workers fed the loop at
    a half to a fifth of the rate of forked ones (1,097 against 1,752 chips/s with 2 workers on
    2 cores; 301 with 2 workers on 16 cores)."""
    import multiprocessing

    multiprocessing.set_start_method(multiprocessing.get_all_start_methods()[0], force=True)


def bench_scale(
    root: str | os.PathLike,
    sizes: list[int],
    config: str | None,
    workers: int = 2,
    batches: int = 40,
    source: str | os.PathLike | None = None,
    device: str = "cpu",
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Make (once) and measure a simulated store of each size; the figures."""
    root = Path(root)
    rows = []
    for n in sizes:
        start = time.perf_counter()
        store = make_sim_store(root, n, source)
        made = time.perf_counter() - start
        # memory its own; its loader workers start as `train`'s do
        with ProcessPoolExecutor(
            1, mp_context=get_context("spawn"), initializer=platform_start_method
        ) as pool:
            row = pool.submit(
                measure_store, store, config, workers, batches, device, overrides
            ).result()
        row["make_s"] = round(made, 1)
        rows.append(row)
    disk = sum(f.stat().st_size for f in (root / "unique").glob("*.npy"))
    return {
        "config": config or "defaults",
        "overrides": list(overrides),
        "source": str(source) if source else "synthetic xBD tiles",
        "unique_mb": round(disk / 2**20, 1),
        "cpu_count": os.cpu_count(),
        "load_average": round(os.getloadavg()[0], 2),
        "rows": rows,
    }


def format_scale(figures: dict[str, Any]) -> str:
    """The figures as a table."""
    lines = [
        f"training at scale, simulated (step on {figures['rows'][0]['device']}): "
        f"config {' '.join([figures['config'], *figures.get('overrides', [])])}, chips from "
        f"{figures['source']} ({figures['unique_mb']:.0f} MiB of unique shards on disk); "
        f"{figures['cpu_count']} CPU cores, load average {figures['load_average']}",
        f"  {'chips':>7}  {'batch':>5}  {'wkrs':>4}  {'loader/s':>8}  {'step/s':>7}  "
        f"{'loop/s':>7}  {'ratio':>5}  {'main MiB':>8}  {'worker MiB':>10}  {'growth':>6}  "
        f"{'train MiB':>9}",
    ]
    for r in figures["rows"]:
        lines.append(
            f"  {r['chips']:>7}  {r['batch_size']:>5}  {r['workers']:>4}  "
            f"{r['loader_chips_per_s']:>8.1f}  {r['step_chips_per_s']:>7.1f}  "
            f"{r['loop_chips_per_s']:>7.1f}  {r['loader_over_step']:>5.2f}  "
            f"{r['main_rss_mb']:>8.0f}  {r['worker_rss_mb']:>10.0f}  {r['growth_mb']:>6.0f}  "
            f"{r['train_rss_mb']:>9.0f}"
        )
    lines.append(
        f"  chips/s of the loader alone, the training step alone (one batch in memory) and both "
        f"as training runs; ratio: loader over step (goal >= {LOADER_GOAL:g}); MiB: peak RSS of the "
        "training process and of the largest loader worker while the loader runs alone, growth "
        "of their sum over that run, and the training process's peak while training"
    )
    return "\n".join(lines)


def run_scale(args: argparse.Namespace) -> int:
    """``bench train --chips``: print the figures."""
    import json
    import tempfile

    try:
        sizes = [int(s) for s in args.chips.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1 or args.loader_workers < 0 or args.timed_batches < 1:
        raise UsageError(
            "--chips takes positive sizes (e.g. 2000,200000); --loader-workers >= 0, "
            "--timed-batches >= 1"
        )
    config = args.config
    default = Path(__file__).resolve().parents[1] / "configs" / "default.yaml"
    if config is None and default.is_file():
        config = str(default)
    from local_damage.config import ConfigError, load_yaml
    from local_damage.train.config import Config

    try:  # a bad override is refused before any store is made
        batch = load_yaml(Config, config, args.overrides).train.batch_size
    except ConfigError as exc:
        raise UsageError(str(exc)) from exc
    if min(sizes) < MIN_BATCHES * batch:  # the warm-up, a timed batch and the loop's two steps
        raise UsageError(
            f"--chips {min(sizes)} gives fewer than {MIN_BATCHES} batches of "
            f"{batch} chips; measure stores of at least {MIN_BATCHES * batch} chips"
        )
    with tempfile.TemporaryDirectory(prefix="bench-train-scale-") as tmp:
        root = Path(args.dir) if args.dir else Path(tmp)
        figures = bench_scale(
            root,
            sizes,
            config,
            args.loader_workers,
            args.timed_batches,
            args.source,
            args.device,
            tuple(args.overrides),
        )
    print(json.dumps(figures, indent=2) if args.json else format_scale(figures))
    return 0
