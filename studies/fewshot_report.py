"""The tables, plot and goal checks of the leave-one-event-out few-shot report.

Input: the measurement rows of :func:`studies.fewshot_run.run_fewshot`, one per held-out
event, repeat, number of labels ``k`` and arm (``adapt-random``, ``adapt-suggested``,
``finetune``), each with the ``accuracy`` and ``macro_f1`` of the rest of the event. ``k = 0``
is the base model, the same figure for every arm. An event's cell is the mean +- sd over its
repeats; the "mean over events" row is the mean of the events' means +- their sd across events.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from data_prep.store import atomic_path

#: The arms, in table and plot order.
ARMS = ("adapt-random", "adapt-suggested", "finetune", "semi")
#: Goal 1: with this many labels ...
GOAL_K = 20
#: ... the mean macro-F1 over events gains at least this much over k = 0.
GOAL_GAIN = 0.10
#: Goal 3: the mean macro-F1 over events at GOAL_K labels is at least this.
GOAL_LEVEL = 0.45
#: Goal 4: a draw is worse when its macro-F1 is below the base model's (k = 0, same repeat) by
#: more than WORSE or its accuracy by more than WORSE_ACCURACY, and at most WORSE_SHARE of the
#: draws may be, at every k.
WORSE = 0.01
WORSE_ACCURACY = 0.02
WORSE_SHARE = 0.05
#: ``intact_damaged``: the share of the intact buildings graded as damaged; ``seconds``: the
#: time fine-tuning took (the fine-tuning arms only).
METRICS = ("macro_f1", "accuracy", "intact_damaged", "seconds")
MEAN_ROW = "mean over events"


def _mean_sd(values: Sequence[float]) -> dict[str, float | int | None]:
    """``{"mean", "sd", "n"}``; sd with n - 1 (0 for one value, None for none)."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return {"mean": None, "sd": None, "n": 0}
    mean = sum(vals) / len(vals)
    sd = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return {"mean": mean, "sd": sd, "n": len(vals)}


def summarise(rows: Sequence[Mapping[str, Any]], ks: Sequence[int]) -> dict[str, Any]:
    """Aggregates of the measurement rows.

    Returns:
        ``{"arms": [...], "events": {event: {arm: {k: {metric: {"mean", "sd", "n"}}}}}, "mean":
        {arm: {k: {metric: ...}}}}`` over the arms measured; ``k`` as a string key (JSON). An arm
        without a figure at some k (e.g. fine-tuning needs 2 labels) has ``n = 0`` there.
    """
    events = list(dict.fromkeys(str(r["event"]) for r in rows))
    arms = [a for a in ARMS if any(r["arm"] == a for r in rows)]
    per_event: dict[str, Any] = {}
    for event in events:
        per_event[event] = {}
        for arm in arms:
            per_event[event][arm] = {}
            for k in ks:
                sel = [
                    r
                    for r in rows
                    if r["event"] == event and r["arm"] == arm and int(r["k"]) == int(k)
                ]
                per_event[event][arm][str(k)] = {
                    m: _mean_sd([r.get(m) for r in sel]) for m in METRICS
                }
    mean: dict[str, Any] = {}
    for arm in arms:
        mean[arm] = {}
        for k in ks:
            mean[arm][str(k)] = {
                m: _mean_sd([per_event[e][arm][str(k)][m]["mean"] for e in events]) for m in METRICS
            }
    return {"arms": arms, "events": per_event, "mean": mean, "worse": worse_shares(rows, arms, ks)}


def worse_shares(rows: Sequence[Mapping[str, Any]], arms, ks) -> dict[str, Any]:
    """Per arm and k > 0: ``{"share", "n"}``, the share of the draws (event and repeat) whose
    macro-F1 is below the base model's of the same repeat by more than :data:`WORSE` or whose
    accuracy is below it by more than :data:`WORSE_ACCURACY`."""
    base = {(r["event"], r["repeat"]): r for r in rows if int(r["k"]) == 0}
    out: dict[str, Any] = {}
    for arm in arms:
        out[arm] = {}
        for k in ks:
            if int(k) == 0:
                continue
            worse = [
                r["macro_f1"] < b["macro_f1"] - WORSE
                or r.get("accuracy", 1.0) < b.get("accuracy", 0.0) - WORSE_ACCURACY
                for r in rows
                if r["arm"] == arm
                and int(r["k"]) == int(k)
                and r.get("macro_f1") is not None
                and (b := base.get((r["event"], r["repeat"]))) is not None
                and b.get("macro_f1") is not None
            ]
            out[arm][str(k)] = {
                "share": (sum(worse) / len(worse)) if worse else None,
                "n": len(worse),
            }
    return out


def worse_table(summary: Mapping[str, Any], ks: Sequence[int]) -> str:
    """Markdown: per arm and k, the share of draws worse than the base model (:data:`WORSE`,
    :data:`WORSE_ACCURACY`)."""
    shown = [k for k in ks if int(k) > 0]
    lines = [
        "| arm | " + " | ".join(f"k = {k}" for k in shown) + " |",
        "|---|" + "---|" * len(shown),
    ]
    for arm, per_k in summary.get("worse", {}).items():
        cells = []
        for k in shown:
            c = per_k.get(str(k)) or {}
            cells.append("" if c.get("share") is None else f"{100 * c['share']:.0f}% of {c['n']}")
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def goals(summary: Mapping[str, Any], ks: Sequence[int]) -> list[dict[str, Any]]:
    """The report's two goals, each ``{"goal", "arm", "value", "passed"}`` (``passed`` None when
    not measured): mean macro-F1 over events at k = 20 at least 0.10 above k = 0, per arm; and
    the suggestion ranking at least as good as random at every k > 0."""
    mean = summary["mean"]
    out: list[dict[str, Any]] = []
    for arm in summary["arms"]:
        text = f"{arm}: macro-F1 gain at k = {GOAL_K} over k = 0 >= {GOAL_GAIN:.2f}"
        base = mean[arm].get("0", {}).get("macro_f1", {}).get("mean")
        at = mean[arm].get(str(GOAL_K), {}).get("macro_f1", {}).get("mean")
        if base is None or at is None:
            out.append({"goal": text, "arm": arm, "value": None, "passed": None})
        else:
            gain = at - base
            out.append(
                {"goal": text, "arm": arm, "value": gain, "passed": gain >= GOAL_GAIN - 1e-12}
            )
    for arm in summary["arms"]:
        at = mean[arm].get(str(GOAL_K), {}).get("macro_f1", {}).get("mean")
        out.append(
            {
                "goal": f"{arm}: mean macro-F1 at k = {GOAL_K} >= {GOAL_LEVEL:.2f}",
                "arm": arm,
                "value": at,
                "passed": None if at is None else at >= GOAL_LEVEL - 1e-12,
            }
        )
        shares = {
            int(k): c["share"]
            for k, c in summary.get("worse", {}).get(arm, {}).items()
            if c["share"] is not None
        }
        out.append(
            {
                "goal": f"{arm}: worse than the base model by > {WORSE} macro-F1 or > "
                f"{WORSE_ACCURACY} accuracy in at most "
                f"{100 * WORSE_SHARE:.0f}% of draws at every k",
                "arm": arm,
                "value": shares or None,
                "passed": all(v <= WORSE_SHARE + 1e-12 for v in shares.values())
                if shares
                else None,
            }
        )
    diffs = {}
    for k in ks:
        if int(k) == 0:
            continue
        s = mean["adapt-suggested"][str(k)]["macro_f1"]["mean"]
        r = mean["adapt-random"][str(k)]["macro_f1"]["mean"]
        if s is not None and r is not None:
            diffs[int(k)] = s - r
    out.append(
        {
            "goal": "adapt-suggested macro-F1 >= adapt-random at every k > 0",
            "arm": "adapt-suggested",
            "value": diffs or None,
            "passed": (all(d >= -1e-12 for d in diffs.values()) if diffs else None),
        }
    )
    return out


def format_goals(checks: Sequence[Mapping[str, Any]]) -> str:
    lines = []
    for g in checks:
        verdict = {True: "PASS", False: "FAIL", None: "not measured"}[g["passed"]]
        value = g["value"]
        if isinstance(value, Mapping):
            shown = ", ".join(f"k={k}: {d:+.3f}" for k, d in value.items())
        else:
            shown = "n/a" if value is None else f"{value:+.3f}"
        lines.append(f"- {verdict}: {g['goal']} ({shown})")
    return "\n".join(lines)


def _cell(stats: Mapping[str, Any] | None, digits: int = 3) -> str:
    if not stats or stats["mean"] is None:
        return "-"
    return f"{stats['mean']:.{digits}f} +- {stats['sd']:.{digits}f}"


def table(
    summary: Mapping[str, Any],
    ks: Sequence[int],
    metric: str,
    arms: Sequence[str] | None = None,
    digits: int = 3,
) -> str:
    """A markdown table of ``metric``: one row per event and arm (``arms``: every arm of the
    summary), then the mean over events."""
    arms = [a for a in (arms or summary["arms"]) if a in summary["arms"]]
    header = ["event", "arm", *(f"k = {k}" for k in ks)]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for event, per_arm in summary["events"].items():
        for arm in arms:
            cells = [_cell(per_arm[arm][str(k)].get(metric), digits) for k in ks]
            lines.append("| " + " | ".join([event, arm, *cells]) + " |")
    for arm in arms:
        cells = [_cell(summary["mean"][arm][str(k)].get(metric), digits) for k in ks]
        lines.append("| " + " | ".join([f"**{MEAN_ROW}**", arm, *cells]) + " |")
    return "\n".join(lines) + "\n"


def markdown(results: Mapping[str, Any]) -> str:
    """The whole ``fewshot.md``: settings, both tables, events skipped, goal checks."""
    ks = results["settings"]["k"]
    s = results["settings"]
    lines = [
        "# Leave-one-event-out few-shot report",
        "",
        f"Chips `{results['chips']}`, config `{results['config']}`"
        + (
            f" with {', '.join(f'`--set {o}`' for o in results['overrides'])}"
            if results["overrides"]
            else ""
        )
        + f"; {s['repeats']} repeat(s), seed {s['seed']}, fine-tuning "
        + (
            f"at most {s['finetune_epochs']} epoch(s) (`adapt --finetune`, cross-validated)"
            if s["finetune_epochs"]
            else "off"
        )
        + f"; classes without a label: {s.get('unlabelled', 'keep')} (`adapt --unlabelled`).",
        "",
        "Each event is held out in turn: a base model is trained on the other events, then per "
        "repeat the event's labelled buildings are split at random into a pool and an evaluation "
        "set; k labels come from the pool (adapt-random, finetune and semi: the first k of a random "
        "order; adapt-suggested: in rounds, the smallest k by `app.adapt.suggest.suggestion_order` "
        "with the base model, a random draw (the random arm's), each larger k adding the top of "
        "the rest ranked with the head adapted to the labels so far: its uncertain buildings "
        "interleaved with the next of the random draw), "
        "and every arm is scored on the same evaluation set. k = 0 is the base model. Cells: mean "
        "+- sd over repeats; the mean rows: mean +- sd over events of the events' means.",
        "",
        "| event | buildings | pool | evaluated | base run |",
        "|---|---|---|---|---|",
    ]
    for event, info in results["events"].items():
        lines.append(
            f"| {event} | {info['n']} | {info['pool']} | {info['eval']} | {info['base']} |"
        )
    lines += ["", "## Macro-F1", "", table(results["summary"], ks, "macro_f1")]
    lines += ["## Accuracy", "", table(results["summary"], ks, "accuracy")]
    lines += [
        "## Intact buildings called damaged",
        "",
        table(results["summary"], ks, "intact_damaged"),
    ]
    tuned = [a for a in ("finetune", "semi") if a in results["summary"]["arms"]]
    if tuned:
        lines += [
            "## Seconds of fine-tuning (cross-validated choice included)",
            "",
            table(results["summary"], ks, "seconds", tuned, digits=0),
        ]
    lines += [
        f"## Share of draws where adapting made it worse (macro-F1 below k = 0 by > {WORSE} "
        f"or accuracy by > {WORSE_ACCURACY})",
        "",
        worse_table(results["summary"], ks),
    ]
    lines += ["## Goals", "", format_goals(results["goals"]), ""]
    if results["skipped"]:
        lines += ["## Events not measured", ""]
        lines += [f"- {item['event']}: {item['reason']}" for item in results["skipped"]]
        lines.append("")
    return "\n".join(lines)


def plot(results: Mapping[str, Any], path: str | Path) -> Path:
    """Macro-F1 against k: per arm the mean over events with a +- sd band and thin per-event
    lines; written atomically as PNG (Agg, no display needed)."""
    from matplotlib.figure import Figure

    ks = [int(k) for k in results["settings"]["k"]]
    summary = results["summary"]
    colours = {
        "adapt-random": "tab:blue",
        "adapt-suggested": "tab:orange",
        "finetune": "tab:green",
        "semi": "tab:red",
    }
    fig = Figure(figsize=(6.5, 4.2))
    ax = fig.subplots()
    for arm in summary["arms"]:
        colour = colours[arm]
        for arms in summary["events"].values():
            pts = [(k, arms[arm][str(k)]["macro_f1"]["mean"]) for k in ks]
            pts = [(k, v) for k, v in pts if v is not None]
            if pts:
                ax.plot(*zip(*pts, strict=True), color=colour, lw=0.7, alpha=0.35)
        stats = [(k, summary["mean"][arm][str(k)]["macro_f1"]) for k in ks]
        stats = [(k, s) for k, s in stats if s["mean"] is not None]
        if not stats:
            continue
        x = [k for k, _ in stats]
        m = [s["mean"] for _, s in stats]
        sd = [s["sd"] for _, s in stats]
        ax.plot(x, m, color=colour, lw=2, marker="o", label=arm)
        ax.fill_between(
            x,
            [a - b for a, b in zip(m, sd, strict=True)],
            [a + b for a, b in zip(m, sd, strict=True)],
            color=colour,
            alpha=0.15,
            lw=0,
        )
    ax.set_xlabel("labelled buildings of the held-out event (k)")
    ax.set_ylabel("macro-F1 on the rest of the event")
    n = len(summary["events"])
    ax.set_title(f"Leave-one-event-out, mean over {n} event(s) (thin: each event)", fontsize=10)
    ax.set_xticks(ks)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    path = Path(path)
    with atomic_path(path, suffix=".png") as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    return path
