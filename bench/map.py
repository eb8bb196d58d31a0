"""`local-damage bench map`: how big the web map of `score --map` is, what it costs to write and
how long a browser takes to draw it.

For each scene (the real Joplin GeoTIFFs with their footprints where ``--joplin`` points at them,
and a synthetic scene of ``--size`` px made by :func:`data_prep.synthetic_scene.make_large_scene`)
the scene is scored twice with the bundled model, exactly as a user runs `local-damage score`
(its own process, with ``--profile``), once without ``--map`` and once with it: what the map costs
to write is the difference of the two runs' ``outputs`` stage (where the map is written beside the
vector file), which the rest of scoring does not blur. The map file is then opened from disk in headless Chromium with
every request outside the file refused, as the browser tests do, and timed from navigation to
the map saying it is drawn (``localDamage.ready``, every building on the map); the page's own
figure for the same (``localDamage.renderMs``) and its JavaScript heap are printed beside it.
Chromium and Playwright come with the ``dev`` extra and Debian's ``chromium``; without them the
sizes and write times are still printed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from data_prep.errors import LocalDamageError
from data_prep.synthetic_scene import make_large_scene

#: Debian's Chromium, what the browser tests use.
CHROMIUM = Path("/usr/bin/chromium")
#: Its switches for a headless run as root in a container.
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
#: The bundled model, which a user scores with.
MODEL = Path(__file__).resolve().parent.parent / "models" / "default.onnx"


def _score(inputs: list[str], out: Path, web_map: Path | None) -> tuple[float, float]:
    """Run `local-damage score --profile --json` on ``inputs`` in its own process; its wall time
    and the seconds of its ``outputs`` stage (where the map is written), in seconds."""
    cmd = [sys.executable, "-m", "cli.main", "score", *inputs, "--model", str(MODEL)]
    cmd += ["--out", str(out), "--quiet", "--profile", "--json"]
    if web_map is not None:
        cmd += ["--map", str(web_map)]
    env = {**os.environ, "PYTHONPATH": str(MODEL.parent.parent)}
    start = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise LocalDamageError(
            f"`{' '.join(cmd)}` failed ({done.returncode}): {done.stderr[-800:]}"
        )
    stages = json.loads(done.stdout).get("stages") or {}
    return seconds, float(stages.get("outputs", 0.0))


def render(path: Path) -> dict[str, Any] | str:
    """Open the map file in headless Chromium offline; its draw times, or why it could not."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        return "Playwright is not installed (pip install -e '.[dev]')"
    if not CHROMIUM.is_file():
        return f"{CHROMIUM} not found (apt-get install chromium)"
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 900})
            blocked: list[str] = []
            page.route(
                "**/*",
                lambda r: (
                    r.continue_()
                    if r.request.url.startswith(("file://", "data:"))
                    else (blocked.append(r.request.url), r.abort())
                ),
            )
            start = time.perf_counter()
            page.goto(path.resolve().as_uri())
            page.wait_for_function("() => window.localDamage && localDamage.ready", timeout=300_000)
            wall_ms = 1000 * (time.perf_counter() - start)
            shown = page.evaluate(
                "() => ({render_ms: localDamage.renderMs, drawn: localDamage.drawn,"
                " scored: localDamage.scored,"
                " heap_mb: performance.memory ? performance.memory.usedJSHeapSize / 2**20 : null})"
            )
        finally:
            browser.close()
    return {"open_to_drawn_ms": wall_ms, **shown, "blocked": len(blocked)}


def measure(name: str, inputs: list[str], work: Path) -> dict[str, Any]:
    """Score ``inputs`` without and with the map; the map's size, write cost and draw times."""
    plain, plain_outputs = _score(inputs, work / f"{name}_plain.geojson", None)
    html = work / f"{name}.html"
    with_map, map_outputs = _score(inputs, work / f"{name}.geojson", html)
    result: dict[str, Any] = {
        "scene": name,
        "map_mb": html.stat().st_size / 2**20,
        "score_s": plain,
        "score_with_map_s": with_map,
        "map_write_s": map_outputs - plain_outputs,
    }
    shown = render(html)
    if isinstance(shown, str):
        result["render"] = shown
    else:
        result.update(shown)
    return result


def _row(r: dict[str, Any]) -> str:
    drawn = f"{r['drawn']:>7} {r['scored']:>7}" if "drawn" in r else f"{'-':>7} {'-':>7}"
    draw = (
        f"{r['open_to_drawn_ms']:>9.0f} {r['render_ms']:>9.0f}"
        if "open_to_drawn_ms" in r
        else f"{'-':>9} {'-':>9}"
    )
    return (
        f"{r['scene']:<16} {r['map_mb']:>7.2f} {r['score_s']:>8.1f} {r['map_write_s']:>8.1f}"
        f" {drawn} {draw}"
    )


def run(args: argparse.Namespace) -> int:
    """Measure the map of each scene and print a table (or JSON)."""
    if not MODEL.is_file():
        raise LocalDamageError(f"{MODEL} is missing: the bundled model ships with the project")
    scenes: list[tuple[str, list[str]]] = []
    if args.joplin:
        root = Path(args.joplin)
        fp = root / "footprints" / "joplin.geojson"
        if not fp.is_file():
            raise LocalDamageError(f"{root}: no footprints/joplin.geojson (the Joplin folder?)")
        pre = sorted(str(p) for p in (root / "pre").glob("*.tif"))
        post = sorted(str(p) for p in (root / "post").glob("*.tif"))
        scenes.append(("joplin", ["--pre", *pre, "--post", *post, "--buildings", str(fp)]))
    with tempfile.TemporaryDirectory(prefix="bench-map-") as tmp:
        work = Path(tmp)
        if args.size:
            n = make_large_scene(work / "large", args.size, seed=args.seed)
            large = work / "large"
            scenes.append(
                (
                    f"synthetic-{args.size}px",
                    [
                        "--pre",
                        str(large / "pre" / "pre.tif"),
                        "--post",
                        str(large / "post" / "post.tif"),
                        "--buildings",
                        str(large / "buildings.geojson"),
                    ],
                )
            )
            print(f"synthetic scene: {args.size} x {args.size} px, {n} buildings", file=sys.stderr)
        results = [measure(name, inputs, work) for name, inputs in scenes]
    if args.json:
        print(json.dumps(results, indent=2))
        return 0
    print(
        f"{'scene':<16} {'map MB':>7} {'score s':>8} {'+map s':>8} {'drawn':>7} {'graded':>7}"
        f" {'open ms':>9} {'draw ms':>9}"
    )
    for r in results:
        print(_row(r))
        if "render" in r:
            print(f"  not drawn: {r['render']}")
    print(
        "score s: `local-damage score` without --map, its own process; +map s: what --map adds "
        "(its outputs stage with the map less without); "
        "open ms: headless Chromium from opening the file to every building drawn; draw ms: "
        "the page's own figure"
    )
    return 0
