"""`local-damage bench app`: the web app under load, measured.

The app runs as its own server process, as an analyst starts it (`local-damage app --host
127.0.0.1`), driven through its HTTP API by one ``gradio_client.Client`` per simulated analyst,
each in a thread: every analyst assesses the same tiles (``/assess_tile``) and saves corrections
after each (``/save_correction``, on the assessment kept in the client's session). After an
untimed first assessment: one analyst, the tiles one after another (the baseline), then
``--clients`` analysts at once. Per level: requests answered, refused (queue full) and failed,
latency p50/p95/max and assessments per second (p50 and rate as ratios to the baseline), the
server's peak resident memory (sampled every 0.2 s), corrections acknowledged and kept in the
label store; then whether the grades were the same every time, the server's queue limits
(:data:`app.web.assess.CONCURRENCY_LIMIT`, :data:`app.web.assess.QUEUE_SIZE`) and the machine.
``--timeout`` bounds the run. The server is stopped at the end, on an error and on Ctrl-C too.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from app.web.assess import CONCURRENCY_LIMIT, IMAGE_SUFFIXES, QUEUE_SIZE
from data_prep.errors import LocalDamageError
from data_prep.label_store import LAYER, STORE_NAME
from runtime.registry import default_model

log = logging.getLogger(__name__)

#: Most simulated analysts per level, most tiles each assesses, the default time limit of the
#: run and the server's time to answer after its start (s), seconds between memory samples.
MAX_CLIENTS, MAX_TILES, TIMEOUT, STARTUP_S, SAMPLE_S = 64, 20, 600.0, 180.0, 0.2
#: The hosts the app may be served on: this machine only.
LOOPBACK = ("127.0.0.1", "localhost")
#: Side in pixels of the synthetic tiles (that of an xBD tile).
SYNTHETIC_SIZE = 1024
#: What a full Gradio queue answers.
QUEUE_FULL = "Queue is full"
#: What became of a request.
STATUSES = ("answered", "refused", "failed", "not sent")
MIB = 1024 * 1024
REPO = Path(__file__).resolve().parent.parent


class AppLoadError(LocalDamageError):
    """A benchmark setting out of bounds, missing tiles, or an app that never answered."""


class Tile(NamedTuple):
    """One xBD tile: its pre and post images and its post label file."""

    name: str
    pre: Path
    post: Path
    label: Path


def find_tiles(folder: str | os.PathLike, count: int) -> list[Tile]:
    """The first ``count`` tiles (by name) of an xBD folder that have a pre and a post image and
    a post label file; :class:`AppLoadError` when it has fewer."""
    folder, tiles = Path(folder), []
    for pre in sorted((folder / "images").glob("*_pre_disaster.*")):
        scene = pre.stem[: -len("_pre_disaster")]
        post = sorted((folder / "images").glob(f"{scene}_post_disaster.*"))
        label = folder / "labels" / f"{scene}_post_disaster.json"
        if pre.suffix.lower() in IMAGE_SUFFIXES and post and label.is_file():
            tiles.append(Tile(scene, pre, post[0], label))
    if len(tiles) < count:
        raise AppLoadError(
            f"{folder}: {len(tiles)} tile(s) with images/<tile>_pre_disaster.*, "
            f"images/<tile>_post_disaster.* and labels/<tile>_post_disaster.json; {count} needed"
        )
    return tiles[:count]


def machine() -> dict[str, Any]:
    """CPU count, CPU model name and memory of this machine."""
    import psutil

    cpuinfo = Path("/proc/cpuinfo")
    info = cpuinfo.read_text().splitlines() if cpuinfo.is_file() else []
    name = next((ln.split(":", 1)[1].strip() for ln in info if ln.startswith("model name")), "")
    gib = psutil.virtual_memory().total / 2**30
    return {"cpus": os.cpu_count(), "cpu_model": name or "unknown", "memory_gib": gib}


def store_rows(work: Path) -> tuple[int | None, str]:
    """Rows of the label store's corrections table, or None and why they cannot be counted."""
    path = work / STORE_NAME
    if not path.is_file():
        return None, f"{STORE_NAME} does not exist"
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
            return int(db.execute(f'select count(*) from "{LAYER}"').fetchone()[0]), ""
    except sqlite3.Error as exc:
        return None, f"{STORE_NAME}: {exc}"


class MemorySampler(threading.Thread):
    """Samples the resident memory of a process and its children every :data:`SAMPLE_S`."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.samples, self.done = pid, [], threading.Event()

    def sample(self) -> int:
        """Sample now; the bytes resident (0 when the process is gone)."""
        import psutil

        total = 0
        try:
            proc = psutil.Process(self.pid)
            for p in [proc, *proc.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    total += p.memory_info().rss
        except psutil.Error:
            return 0
        self.samples.append((time.perf_counter(), total))
        return total

    def run(self) -> None:
        while not self.done.wait(SAMPLE_S):
            self.sample()

    def peak(self, since: float = 0.0, until: float = float("inf")) -> int:
        """The most bytes resident sampled between ``since`` and ``until``."""
        return max((m for t, m in self.samples if since <= t <= until), default=0)


class Server:
    """`local-damage app` in its own process on a free port; a context manager that waits until
    it answers, samples its memory and stops it (and its children) on the way out."""

    def __init__(self, model: Path, host: str, folder: Path) -> None:
        with socket.socket() as s:  # a port free now
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://{host}:{self.port}/"
        self.work, self.err = folder / "work", folder / "server.err"
        self.cmd = [sys.executable, "-m", "cli.main", "app", "--port", str(self.port)]
        self.cmd += ["--host", host, "--work", str(self.work), "--model", str(model)]
        self.proc, self.memory, self.startup_s = None, MemorySampler(0), 0.0

    def tail(self, lines: int = 15) -> str:
        """The last lines the server wrote to its standard error."""
        try:
            return "\n".join(self.err.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def __enter__(self) -> Server:
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PYTHONPATH": path, "GRADIO_ANALYTICS_ENABLED": "False"}
        start = time.perf_counter()
        with open(self.err, "wb") as err:  # its own session: a Ctrl-C reaches the benchmark only
            self.proc = subprocess.Popen(self.cmd, stdin=subprocess.DEVNULL, stdout=err,
                                         stderr=err, env=env, start_new_session=True)  # fmt: skip
        try:
            self._wait(start)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        self.memory = MemorySampler(self.proc.pid)
        self.memory.sample()
        self.memory.start()
        return self

    def _wait(self, start: float) -> None:
        while self.proc.poll() is None:
            try:
                with urllib.request.urlopen(self.url, timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:  # not listening yet
                pass
            if time.perf_counter() - start > STARTUP_S:
                why = f"did not answer on {self.url} within {STARTUP_S:g} s"
                break
            time.sleep(0.25)
        else:
            why = f"exited (status {self.proc.returncode}) before it answered"
        raise AppLoadError(f"the app {why}; `{' '.join(self.cmd)}` said:\n{self.tail()}")

    def stop(self) -> None:
        """Stop the server and its children (at once when it does not stop within 10 s)."""
        import psutil

        self.memory.done.set()
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            children = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.Error:
            children = []
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        for child in children:
            with contextlib.suppress(psutil.Error):
                child.kill()

    def __exit__(self, *exc) -> None:
        self.stop()


def call(client, args: tuple, api: str, deadline: float) -> tuple[str, float | None, Any, str]:
    """One request to endpoint ``api``: ``(status, seconds, answer, error)``, status one of
    :data:`STATUSES` (``refused``: the queue was full; ``not sent``: past the deadline, at which
    an unanswered request fails)."""
    if time.perf_counter() >= deadline:
        return "not sent", None, None, ""
    start, job = time.perf_counter(), None
    try:
        job = client.submit(*args, api_name=api)
        answer = job.result(timeout=max(0.0, deadline - time.perf_counter()))
    except concurrent.futures.TimeoutError:
        if job is not None:
            job.cancel()
        return "failed", time.perf_counter() - start, None, "no answer within the time limit"
    except Exception as exc:
        refused = QUEUE_FULL in str(exc) or type(exc).__name__ == "QueueError"
        error = str(exc) if refused else f"{type(exc).__name__}: {exc}"
        return "refused" if refused else "failed", time.perf_counter() - start, None, error
    return "answered", time.perf_counter() - start, answer, ""


def grades_of(table: dict[str, Any]) -> list[str]:
    """The damage column of the app's building table (``{"headers", "data"}``)."""
    column = table["headers"].index("damage")
    return [str(row[column]) for row in table["data"]]


def assess(client, model: str, tile: Tile, deadline: float):
    """``/assess_tile`` of one tile, false-alarm cost 1 (see :func:`call`)."""
    from gradio_client import handle_file

    files = [handle_file(str(p)) for p in (tile.pre, tile.post, tile.label)]
    return call(client, (model, *files, 1), "/assess_tile", deadline)


def connect(url: str, count: int, downloads: Path) -> list:
    """``count`` gradio clients of ``url``; where one could not connect, its error message."""
    from gradio_client import Client

    clients: list = []
    for _ in range(count):
        try:
            clients.append(Client(url, verbose=False, download_files=str(downloads)))
        except Exception as exc:
            clients.append(f"a client could not connect: {type(exc).__name__}: {exc}")
    return clients


def close(clients: list) -> None:
    """Close the clients (their heartbeat threads)."""
    for c in clients:
        if not isinstance(c, str):
            with contextlib.suppress(Exception):
                c.close()


class Level:
    """One load level: ``clients`` analysts at once, each assessing every tile (each starting at
    a different one) and saving corrections after each assessment; ``run`` holds the settings."""

    def __init__(self, name: str, clients: int, run: dict[str, Any]) -> None:
        self.name, self.clients, self.run = name, clients, run
        self.assessments, self.corrections = [], []  # one dict per request
        self.lock = threading.Lock()

    def analyst(self, index: int, client) -> None:
        """Client ``index`` assesses every tile in turn (a thread)."""
        run, tiles = self.run, self.run["tiles"]
        for k in range(len(tiles)):
            tile = tiles[(index + k) % len(tiles)]
            if run["stop"].is_set() or isinstance(client, str):
                why = client if isinstance(client, str) else "interrupted"
                status, seconds, answer, error = "not sent", None, None, why
            else:
                status, seconds, answer, error = assess(client, run["model"], tile, run["deadline"])
            try:
                grades = grades_of(answer[2]) if status == "answered" else None
            except (KeyError, ValueError, TypeError, IndexError) as exc:
                status, grades, error = "failed", None, f"no building table in the answer: {exc!r}"
            saved = self.correct(client, grades) if grades else []
            with self.lock:
                self.assessments.append({"tile": tile.name, "status": status, "seconds": seconds,
                                         "grades": grades, "error": error})  # fmt: skip
                self.corrections += saved
                done = len(self.assessments)
            how = f" in {seconds:.2f} s" if seconds is not None else ""
            ack = sum(c["status"] == "answered" for c in saved)
            log.info("%s: client %d/%d %s: %s%s, %d correction(s) saved (%d/%d)", self.name,
                     index + 1, self.clients, tile.name, status, how, ack, done,
                     self.clients * len(tiles))  # fmt: skip

    def correct(self, client, grades: list[str]) -> list[dict[str, Any]]:
        """Save corrections of the first buildings of an assessment: each the class after the
        one predicted (the one predicted when the endpoint names no classes)."""
        out, deadline = [], self.run["deadline"]
        for row in range(min(self.run["corrections"], len(grades)) if self.run["endpoint"] else 0):
            pick = self.run["classes"] or [grades[row]]
            damage = pick[(pick.index(grades[row]) + 1) % len(pick) if grades[row] in pick else 0]
            status, seconds, _, error = call(client, (row, damage), "/save_correction", deadline)
            out.append({"status": status, "seconds": seconds, "error": error})
        return out

    def measure(self, clients: list) -> dict[str, Any]:
        """Run the analysts, one thread each; the level's figures."""
        before, _ = store_rows(self.run["work"])
        go = self.analyst
        threads = [threading.Thread(target=go, args=a, daemon=True) for a in enumerate(clients)]
        memory, start = self.run["memory"], time.perf_counter()
        memory.sample()
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(0.1)
        wall = time.perf_counter() - start
        memory.sample()
        after, note = store_rows(self.run["work"])
        out = {"level": self.name, "clients": self.clients, "tiles": len(self.run["tiles"])}
        out |= tally(self.assessments)
        peak = memory.peak(start, time.perf_counter())
        per_s = out["answered"] / wall if wall > 0 else None
        out |= {"wall_s": wall, "per_s": per_s, "memory_peak_mib": peak / MIB}
        fixes = tally(self.corrections)
        kept = None if after is None else after - (before or 0)
        fixes |= {"acknowledged": fixes["answered"], "kept": kept, "store_note": note}
        errors = [a["error"] for a in self.assessments + self.corrections if a["error"]]
        errors = [e for e in dict.fromkeys(errors) if QUEUE_FULL not in e]
        out |= {"corrections": fixes, "errors": errors[:3]}
        out["_grades"] = [(a["tile"], a["grades"]) for a in self.assessments if a["grades"]]
        return out


def tally(requests: list[dict[str, Any]]) -> dict[str, Any]:
    """Requests sent and of each status, and the seconds of the answered ones (p50, p95, max)."""
    n = {s: sum(r["status"] == s for r in requests) for s in STATUSES}
    seconds = [r["seconds"] for r in requests if r["status"] == "answered"]
    p50, p95 = np.percentile(seconds, [50, 95]).tolist() if seconds else (None, None)
    return {"sent": n["answered"] + n["refused"] + n["failed"],
            **{s.replace(" ", "_"): n[s] for s in STATUSES},
            "p50_s": p50, "p95_s": p95, "max_s": max(seconds, default=None)}  # fmt: skip


@dataclass(frozen=True)
class AppLoadOptions:
    """The load `bench app` puts on the app (the flags of the same names).

    Attributes:
        clients: one load level per count: that many simulated analysts at once (each at most
            :data:`MAX_CLIENTS`).
        tiles: tiles each analyst assesses (at most :data:`MAX_TILES`).
        corrections: corrections saved after each assessment.
        tiles_dir: xBD folder whose first ``tiles`` tiles are assessed (None: synthetic tiles).
        timeout: seconds from the app's first answer after which nothing more is sent.
        baseline: measure one analyst, the tiles one after another, first (the ratios' base).
        host: interface the app binds: ``127.0.0.1`` or ``localhost`` (:data:`LOOPBACK`).
        tile_size: side in pixels of the synthetic tiles.
    """

    clients: tuple[int, ...] = (8,)
    tiles: int = 2
    corrections: int = 2
    tiles_dir: str | os.PathLike | None = None
    timeout: float = TIMEOUT
    baseline: bool = True
    host: str = "127.0.0.1"
    tile_size: int = SYNTHETIC_SIZE


def bench_app(
    model: str | os.PathLike | None = None, options: AppLoadOptions | None = None
) -> dict[str, Any]:
    """Serve the app in its own process (a temporary work folder) and measure it: the baseline
    (unless ``options.baseline`` is False), then ``n`` clients at once for each ``n`` of
    ``options.clients``.

    Args:
        model: the model file (None: the bundled default model).
        options: the load (default ``AppLoadOptions()``).

    Returns:
        The figures (:func:`format_result` prints them); ``levels``: one entry per level.

    Raises:
        AppLoadError: a setting out of bounds (a host other than loopback), too few tiles, an
            app that did not start or answer.
    """
    o = options or AppLoadOptions()
    clients, tiles, tiles_dir = list(o.clients), o.tiles, o.tiles_dir
    if o.host not in LOOPBACK:
        raise AppLoadError(f"--host {o.host}: the app is served on 127.0.0.1 or localhost only")
    if not clients or min(clients) < 1 or max(clients) > MAX_CLIENTS:
        raise AppLoadError(f"--clients must be between 1 and {MAX_CLIENTS}, got {clients}")
    if not 1 <= tiles <= MAX_TILES:
        raise AppLoadError(f"--tiles must be between 1 and {MAX_TILES}, got {tiles}")
    if o.corrections < 0 or not o.timeout > 0:
        raise AppLoadError(
            f"--corrections {o.corrections} --timeout {o.timeout:g}: give C >= 0, S > 0"
        )
    model = Path(model if model is not None else default_model()).resolve()
    with tempfile.TemporaryDirectory(prefix="bench-app-", ignore_cleanup_errors=True) as tmp:
        tmp = Path(tmp)
        source = f"xBD tile(s) of {tiles_dir}"
        if tiles_dir is None:
            from data_prep.synthetic import make_xbd

            try:
                tiles_dir = make_xbd(tmp / "tiles", seed=0, n_tiles=tiles, size=o.tile_size)
            except ValueError as exc:
                raise AppLoadError(f"synthetic tiles: {exc}") from exc
            source = f"synthetic {o.tile_size} px tile(s) (data_prep.synthetic, not real imagery)"
        chosen = find_tiles(tiles_dir, tiles)
        (tmp / "downloads").mkdir()
        run = {"tiles": chosen, "model": str(model), "corrections": o.corrections,
               "timeout": o.timeout, "stop": threading.Event(),
               "downloads": tmp / "downloads", "classes": []}  # fmt: skip
        with Server(model, o.host, tmp) as server:
            plan = [("baseline", 1)] if o.baseline else []
            plan += [(f"{n} clients", n) for n in clients]
            result = measure(server, run, plan)
    return {"model": str(model), "tiles": source, "tile_names": [t.name for t in chosen],
            "corrections_per_assessment": o.corrections, "timeout_s": o.timeout, **result}  # fmt: skip


def measure(server: Server, run: dict[str, Any], plan: list[tuple[str, int]]) -> dict[str, Any]:
    """The untimed first assessment, then each level of ``plan`` (name, clients)."""
    start_mib, deadline = server.memory.peak() / MIB, time.perf_counter() + run["timeout"]
    run["deadline"] = deadline  # the time limit counts from the server's first answer
    run |= {"memory": server.memory, "work": server.work}
    (probe,) = connect(server.url, 1, run["downloads"])
    if isinstance(probe, str):
        raise AppLoadError(f"{server.url}: {probe}\n{server.tail()}")
    endpoints = probe.view_api(return_format="dict", print_info=False)["named_endpoints"]
    run["endpoint"] = has_corrections = "/save_correction" in endpoints
    for p in endpoints.get("/save_correction", {}).get("parameters", []):
        run["classes"] = run["classes"] or p["type"].get("enum") or []
    status, warm_s, answer, error = assess(probe, run["model"], run["tiles"][0], deadline)
    close([probe])
    if status != "answered":
        raise AppLoadError(f"the first assessment of {run['tiles'][0].name}: {status}, {error}")
    warm_mib = server.memory.sample() / MIB
    levels, grades = [], [(run["tiles"][0].name, grades_of(answer[2]))]
    for name, n in plan:
        clients = connect(server.url, n, run["downloads"])
        try:
            levels.append(Level(name, n, run).measure(clients))
        except KeyboardInterrupt:
            run["stop"].set()
            raise
        finally:
            close(clients)
        grades += levels[-1].pop("_grades")
    base = levels[0] if plan[0][0] == "baseline" else None
    for lv in levels:
        ok = base and base["p50_s"] and lv["p50_s"] and base["per_s"]
        lv["baseline"] = lv is base
        lv["p50_ratio"] = lv["p50_s"] / base["p50_s"] if ok else None
        lv["per_s_ratio"] = lv["per_s"] / base["per_s"] if ok else None
    seen: dict[str, set] = {}
    for tile, g in grades:
        seen.setdefault(tile, set()).add(tuple(g))
    differing = sorted(t for t, g in seen.items() if len(g) > 1)
    rows, note = store_rows(server.work)
    server_figures = {"command": " ".join(server.cmd), "startup_s": server.startup_s,
                      "memory_start_mib": start_mib, "memory_after_warmup_mib": warm_mib,
                      "memory_peak_mib": server.memory.peak() / MIB, "warmup_s": warm_s}  # fmt: skip
    return {
        "url": server.url,
        "time_limit_reached": time.perf_counter() >= deadline,
        "limits": {"concurrency_limit": CONCURRENCY_LIMIT, "queue_size": QUEUE_SIZE},
        "machine": machine(),
        "server": server_figures,
        "corrections_endpoint": has_corrections,
        "classes": run["classes"],
        "levels": levels,
        "grades": {"tiles": len(seen), "assessments": len(grades), "differing": differing},
        "store": {"rows": rows, "note": note},
    }


def _f(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


#: Columns of the table: heading, width.
COLUMNS = [("level", -12), ("sent", 5), ("answered", 9), ("refused", 8), ("failed", 7),
           ("unsent", 7), ("p50 s", 7), ("p95 s", 7), ("max s", 7), ("assess/s", 9),
           ("p50/base", 9), ("rate/base", 10), ("peak MiB", 9), ("corr kept/ack", 14)]  # fmt: skip


def _row(cells: list) -> str:
    widths = [w for _, w in COLUMNS]
    cells = [f"{v:<{-w}}" if w < 0 else f"{v:>{w}}" for v, w in zip(cells, widths, strict=True)]
    return "".join(cells)


def format_result(result: dict[str, Any]) -> str:
    """The figures as a plain-text table."""
    m, s, lim, levels = result["machine"], result["server"], result["limits"], result["levels"]
    lines = [
        f"local-damage app under load: {Path(result['model']).name}, {len(result['tile_names'])} "
        f"{result['tiles']}, each assessment followed by {result['corrections_per_assessment']} "
        f"correction(s); server {result['url']}",
        f"server limits: CONCURRENCY_LIMIT {lim['concurrency_limit']} (requests processed at "
        f"once per event), QUEUE_SIZE {lim['queue_size']} (requests allowed to wait)",
        f"machine: {m['cpus']} CPUs, {m['cpu_model']}, {m['memory_gib']:.1f} GiB",
        f"server: answered {s['startup_s']:.1f} s after start; memory {s['memory_start_mib']:.0f} "
        f"MiB at start, {s['memory_after_warmup_mib']:.0f} MiB after the untimed first "
        f"assessment ({s['warmup_s']:.2f} s), peak {s['memory_peak_mib']:.0f} MiB",
        "",
        _row([h for h, _ in COLUMNS]),
    ]
    for lv in levels:
        c, endpoint = lv["corrections"], result["corrections_endpoint"]
        kept = c["kept"] if endpoint and c["kept"] is not None else "-"
        cells = [f"{lv['level']}{'*' if lv['baseline'] else ''}", lv["sent"], lv["answered"],
                 lv["refused"], lv["failed"], lv["not_sent"], _f(lv["p50_s"]), _f(lv["p95_s"]),
                 _f(lv["max_s"]), _f(lv["per_s"], ".3f"), _f(lv["p50_ratio"], ".2f", "x"),
                 _f(lv["per_s_ratio"], ".2f", "x"), f"{lv['memory_peak_mib']:.0f}",
                 f"{kept}/{c['acknowledged'] if endpoint else '-'}"]  # fmt: skip
        lines.append(_row(cells))
    if any(lv["baseline"] for lv in levels):
        lines.append(
            "* baseline: one client, the tiles one after another; p50/base: latency ratio, "
            "rate/base: assessments-per-second ratio"
        )
    lines.append(
        "latency: seconds per /assess_tile request (upload, queue, grading, answer); assess/s: "
        "assessments answered over the level's wall time (corrections included)"
    )
    g, differ = result["grades"], ", ".join(result["grades"]["differing"])
    same = f"the same every time for all {g['tiles']} tile(s) over {g['assessments']} assessments"
    count = f"{len(g['differing'])} of {g['tiles']} tile(s) got differing grades: {differ}"
    lines.append(f"grades: {count if differ else same}")
    if not result["corrections_endpoint"]:
        lines.append("corrections: not measured (the app has no save_correction endpoint)")
    elif result["corrections_per_assessment"]:
        fixes = {k: sum(lv["corrections"][k] for lv in levels) for k in STATUSES[:3]}
        store = result["store"]
        kept = f"{store['rows']} kept" if store["rows"] is not None else store["note"]
        p50 = ", ".join(_f(lv["corrections"]["p50_s"]) for lv in levels)
        lines.append(
            f"corrections: {fixes['answered']} acknowledged ({fixes['refused']} refused, "
            f"{fixes['failed']} failed), {kept} in the label store {STORE_NAME}; "
            f"/save_correction p50 per level: {p50} s"
        )
    if result["time_limit_reached"]:
        unsent = sum(lv["not_sent"] for lv in levels)
        lines.append(f"time limit {result['timeout_s']:g} s reached: {unsent} assessment(s) unsent")
    lines += [f"{lv['level']} error: {e[:300]}" for lv in levels for e in lv["errors"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    options = AppLoadOptions(
        clients=tuple(args.clients), tiles=args.tiles, corrections=args.corrections,
        tiles_dir=args.tiles_dir, timeout=args.timeout, baseline=not args.no_baseline,
        host=args.host, tile_size=args.tile_size,
    )  # fmt: skip
    result = bench_app(args.model, options)
    print(json.dumps(result, indent=2, default=str) if args.json else format_result(result))
    return 0
