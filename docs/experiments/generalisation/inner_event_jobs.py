"""The runs of `cv --inner K --inner-by event` as separate jobs, so that several run at once (on a
lent GPU, or on two machines) and `cv` then makes the choice from the finished runs.

    python docs/experiments/generalisation/inner_event_jobs.py plan CHIPS OUTER K IDS.json
    python docs/experiments/generalisation/inner_event_jobs.py run CONFIG CHIPS IDS.json JOB RUN \
        [--set KEY=VALUE ...]

`plan` writes, for outer fold OUTER of CHIPS/splits.csv, the chip ids of each of the K inner folds
by event (`data_prep.split.inner_event_folds`, as `cv` makes them: inner fold j holds out the
j-th training event by labelled buildings) and the ids of the outer training set (every labelled
chip outside OUTER). The ids travel where the store may not hold the outer fold at all (a store
without the held-out event is half the upload).

`run` trains CONFIG on job JOB's training ids into RUN. JOB is an inner fold number: the run is
trained and evaluated on the held-out event as `cv` does (`local_damage.experiments.nested.
inner_run`; place it at OUT/inner-event/outer<F>/<name>/fold<J> and `cv` reuses it), or "outer":
the run is trained on the whole outer training set without validation (as `cv` trains the
outer fold), to be evaluated where the held-out event is (`cv` evaluates a trained run it finds
in OUT/selected/fold<F> or OUT/<name>/fold<F>).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_prep.split import inner_event_folds, load_splits
from data_prep.store import read_manifest, write_json
from local_damage.config import load_yaml
from local_damage.train.config import Config
from local_damage.train.loaders import ChipSplit
from local_damage.train.loop import train

OUTER = "outer"


def plan(chips: str, outer: int, inner: int) -> dict:
    """Chip ids of each inner fold by event of ``outer`` and of the outer training set."""
    manifest = read_manifest(chips)
    folds = inner_event_folds(load_splits(chips), manifest, outer, inner)
    labelled = set(manifest.loc[manifest["label"] >= 0, "chip_id"])
    jobs = {}
    for j in range(inner):
        held = folds["fold"] == j
        jobs[str(j)] = {
            "event": sorted(folds.loc[held, "event"].unique()),
            "train": folds.loc[~held, "chip_id"].tolist(),
            "test": [c for c in folds.loc[held, "chip_id"] if c in labelled],
        }
    jobs[OUTER] = {"event": [], "train": folds["chip_id"].tolist(), "test": []}
    return {"chips": str(chips), "outer_fold": outer, "inner": inner, "jobs": jobs}


def run(config: str, chips: str, ids: str, job: str, out: str, overrides: list[str]) -> None:
    """Train (and, for an inner fold, evaluate) one job of a plan."""
    from local_damage.experiments.nested import inner_run

    try:
        jobs = json.loads(Path(ids).read_text())["jobs"]
    except (OSError, ValueError, KeyError) as exc:
        raise SystemExit(
            f"{ids}: not a plan written by `inner_event_jobs.py plan` ({exc})"
        ) from exc
    if job not in jobs:
        raise SystemExit(f"{ids}: no job {job!r}; the plan's jobs are {', '.join(jobs)}")
    spec = jobs[job]
    cfg = load_yaml(Config, config, overrides)
    if job == OUTER:
        train(cfg, chips, Path(out), ChipSplit(ids=(spec["train"], [])), progress=False)
        return
    metrics = inner_run(cfg, chips, Path(out), spec["train"], spec["test"], progress=False)
    print(f"{out}: {', '.join(spec['event'])} macro-F1 {metrics['macro_f1']:.4f}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("plan", help="write the chip ids of each job")
    a.add_argument("chips")
    a.add_argument("outer", type=int)
    a.add_argument("inner", type=int)
    a.add_argument("ids")
    b = sub.add_parser("run", help="train (and evaluate) one job")
    b.add_argument("config")
    b.add_argument("chips")
    b.add_argument("ids")
    b.add_argument("job")
    b.add_argument("out")
    b.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)
    if args.command == "plan":
        result = plan(args.chips, args.outer, args.inner)
        write_json(args.ids, result)
        for job, spec in result["jobs"].items():
            print(f"{job}: held out {', '.join(spec['event']) or '-'}, train {len(spec['train'])}")
        return 0
    run(args.config, args.chips, args.ids, args.job, args.out, args.set)
    return 0


if __name__ == "__main__":
    sys.exit(main())
