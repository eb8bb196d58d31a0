"""Independent jobs on a Dask cluster: an embedded local one by default, or an existing one.

`score-batch` (one job per scene) and `prepare xbd` (one job per tile) hand their jobs to
:func:`map_jobs`; the per-scene and per-tile functions stay plain functions. Where the jobs run:

- ``scheduler`` given (``tcp://host:8786``), or the ``DASK_SCHEDULER_ADDRESS`` environment
  variable set: on that cluster (``dask scheduler`` + ``dask worker`` processes started by hand,
  by dask-jobqueue or on Kubernetes; see docs/cluster.md). Workers must see the same paths as
  this machine (shared storage) and have local-damage installed.
- else ``workers`` > 1 (default: the machine's cores): an embedded ``LocalCluster`` of that many
  single-threaded worker processes, started here and closed at the end.
- else (one worker): in this process, no cluster.

Dask reruns the jobs of a worker that dies on another worker (a job is retried on up to
:data:`ALLOWED_FAILURES` workers), so the jobs must be idempotent: each writes its outputs under
temporary names and renames them into place, and only small summaries travel back to the client.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from data_prep.errors import LocalDamageError

#: Environment variable naming an existing scheduler (Dask's own convention).
SCHEDULER_ENV = "DASK_SCHEDULER_ADDRESS"
#: Workers a job may kill (or lose) before it counts as failed.
ALLOWED_FAILURES = 3
#: Seconds to wait for an existing scheduler to answer.
CONNECT_TIMEOUT = 10


class EngineError(LocalDamageError, RuntimeError):
    """The cluster cannot be reached or started; the message says which and what to do."""


@dataclass(frozen=True)
class JobFailed:
    """The result of a job that raised, or whose workers kept dying (``KilledWorker``)."""

    error: str

    @classmethod
    def of(cls, exc: BaseException) -> JobFailed:
        name = type(exc).__name__
        if name == "KilledWorker":
            return cls(
                f"its worker process died {ALLOWED_FAILURES} times while running it (out of "
                "memory, or a crash in a library); run it alone with --workers 1 to see why"
            )
        return cls(f"{name}: {exc}")


@dataclass(frozen=True)
class Engine:
    """Where a batch's jobs run, the one options object of every command that takes
    ``--workers``/``--scheduler`` (see the module docstring).

    Attributes:
        workers: worker processes of the embedded cluster (None: one per core; 1: in this
            process, no cluster).
        scheduler: address of an existing Dask scheduler (None: ``$DASK_SCHEDULER_ADDRESS``, else
            the embedded cluster).
        client: an open ``distributed.Client`` to run on instead (the caller keeps it open).
    """

    workers: int | None = 1
    scheduler: str | None = None
    client: Any = None

    def worker_count(self, jobs: int | None = None) -> int:
        """Worker processes of the embedded cluster for ``jobs`` jobs: ``workers`` (None: one
        per core), at most ``jobs`` so that no worker starts idle, at least one."""
        workers = default_workers() if self.workers is None else int(self.workers)
        return workers if jobs is None else max(min(workers, int(jobs)), 1)

    @contextmanager
    def open(self, jobs: int | None = None) -> Iterator[Any]:
        """The client to hand :func:`map_jobs`: the given ``client``, else :func:`open_client` of
        :meth:`worker_count` and ``scheduler``."""
        if self.client is not None:
            yield self.client
            return
        with open_client(self.worker_count(jobs), self.scheduler) as client:
            yield client


def default_workers() -> int:
    """Worker processes of the embedded cluster: one per core."""
    return max(os.cpu_count() or 1, 1)


#: glibc ``mallopt`` settings for processes that decode whole images (:func:`tune_malloc`).
MMAP_THRESHOLD = 32 << 20  # glibc's largest: a whole 1024 px RGB tile (3 MB) comes from the heap
TRIM_THRESHOLD = 256 << 20  # free heap kept for the next tile instead of given back at once

_TUNED = False


def tune_malloc() -> bool:
    """Let this process reuse the memory of one decoded image for the next (glibc only).

    By default glibc serves each multi-megabyte image array with a fresh ``mmap`` (or gives a
    freed one straight back to the system), so every tile's pixels are page-faulted and zeroed
    afresh by the kernel: about a tenth of the time of decoding an xBD tile here
    (docs/benchmarks.md). Fixing the mmap threshold at 32 MB and the trim
    threshold at 256 MB keeps freed arrays in the heap for the next one; a process then holds on
    to at most that much free memory. Called by every `prepare xbd` tile job (idempotent);
    returns whether the settings apply (False where the C library is not glibc).
    """
    global _TUNED
    if _TUNED:
        return True
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: leave the allocator as it is
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    _TUNED = bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(
        mallopt(m_trim_threshold, TRIM_THRESHOLD)
    )
    return _TUNED


def scheduler_address(scheduler: str | None = None) -> str | None:
    """``scheduler``, else ``$DASK_SCHEDULER_ADDRESS``, else None (no existing cluster)."""
    address = (scheduler or os.environ.get(SCHEDULER_ENV, "")).strip()
    return address or None


def threads_per_worker(workers: int) -> int:
    """Compute threads (ONNX Runtime, OpenCV) each of ``workers`` processes on this machine may
    use so that together they fill its cores without oversubscribing them."""
    return max(default_workers() // max(int(workers), 1), 1)


@contextmanager
def open_client(workers: int | None = None, scheduler: str | None = None) -> Iterator[Any]:
    """A ``distributed.Client`` on the cluster the arguments name (see the module docstring);
    None when the jobs should run in this process (one worker, no scheduler).

    Raises:
        EngineError: the scheduler does not answer, or the local cluster cannot start.
    """
    address = scheduler_address(scheduler)
    workers = default_workers() if workers is None else int(workers)
    if address is None and workers <= 1:
        yield None
        return
    import dask
    from distributed import Client, LocalCluster

    with dask.config.set(
        {
            "distributed.scheduler.allowed-failures": ALLOWED_FAILURES,
            "distributed.worker.daemon": False,
            "distributed.logging.distributed": "error",
            # Dask sets MALLOC_TRIM_THRESHOLD_ in the embedded cluster's workers, which also
            # turns off glibc's adaptive mmap threshold: every whole-tile array is then mapped
            # and page-faulted afresh, and decoding a tile took ~35% more CPU (bench prepare).
            # Leave glibc's defaults.
            "distributed.nanny.pre-spawn-environ.MALLOC_TRIM_THRESHOLD_": None,
            # Dask's periodic bookkeeping runs on the same cores as the jobs: no statistical
            # profiler sampling the workers' stacks every 10 ms (it feeds only the dashboard's
            # profile page), memory and system monitors polled every second or two instead of
            # ten times a second (an idle 2-worker cluster used 0.10 CPU seconds a second, 0.06
            # with these). Memory limits are still enforced, a second later at most.
            "distributed.worker.profile.enabled": False,
            "distributed.worker.memory.monitor-interval": "1s",
            "distributed.admin.system-monitor.interval": "2s",
        }
    ):
        if address is not None:
            try:
                client = Client(address, timeout=CONNECT_TIMEOUT)
            except (OSError, TimeoutError) as exc:
                raise EngineError(
                    f"Dask scheduler {address} did not answer within {CONNECT_TIMEOUT} s ({exc}); "
                    "start one with `dask scheduler` and workers with `dask worker "
                    f"{address}`, or leave out --scheduler / {SCHEDULER_ENV} to run on this "
                    "machine"
                ) from exc
            with client:
                yield client
            return
        try:
            cluster = LocalCluster(
                n_workers=workers,
                threads_per_worker=1,
                processes=True,
                dashboard_address=":0",  # any free port: several clusters may run at once
                silence_logs=50,
            )
        except Exception as exc:  # distributed raises several types when processes fail to start
            raise EngineError(
                f"could not start a local Dask cluster of {workers} workers "
                f"({type(exc).__name__}: {exc}); try --workers 1"
            ) from exc
        with cluster, Client(cluster) as client:
            yield client


@dataclass(frozen=True)
class Bar:
    """The progress bar of :func:`map_jobs` over finished jobs.

    Attributes:
        desc, unit: the bar's label and unit.
        show: a tqdm bar on stderr (None: only when stderr is a terminal).
    """

    desc: str = "jobs"
    unit: str = "job"
    show: bool | None = None


def map_jobs(
    func: Callable[[Any], Any],
    items: Sequence[Any],
    *,
    client: Any = None,
    keys: Sequence[str] | None = None,
    bar: Bar | None = None,
    costs: Sequence[float] | None = None,
    on_result: Callable[[int, Any], None] | None = None,
    tasks: int | None = None,
) -> list[Any]:
    """``[func(item) for item in items]``, on ``client``'s cluster when one is given.

    Args:
        func: a picklable function of one argument (importable at module level).
        items: one argument per job.
        client: from :func:`open_client`; None runs the jobs here, in order.
        keys: a stable, unique name per job (e.g. the scene name): the task keys on the
            cluster, so that a job is recognisable in the scheduler's logs.
        bar: the progress bar over finished jobs (default :class:`Bar`).
        costs: expected work per job; the costliest are submitted first, so that no large job is
            left running alone at the end.
        on_result: called with ``(index, result)`` as each job finishes (in completion order).
        tasks: run the jobs as this many cluster tasks (:func:`group_jobs`, balanced by
            ``costs``; see :func:`task_count`) instead of one task per job: each task costs the
            scheduler and the client a few milliseconds, a large share of a small job's time on
            a machine with few cores. A worker lost mid-group reruns the whole group elsewhere
            (the jobs are idempotent).

    Returns:
        The results in input order; a job that raised (or lost its worker too often) gives a
        :class:`JobFailed` instead, and the other jobs go on.
    """
    import uuid

    from tqdm import tqdm

    items = list(items)
    spec = bar or Bar()
    bar = tqdm(
        total=len(items),
        desc=spec.desc,
        unit=spec.unit,
        disable=(not sys.stderr.isatty()) if spec.show is None else not spec.show,
        file=sys.stderr,
    )
    results: list[Any] = [None] * len(items)

    def done(i: int, result: Any) -> None:
        results[i] = result
        if on_result is not None:
            on_result(i, result)
        bar.update()

    try:
        if client is None:
            for i, item in enumerate(items):
                try:
                    result = func(item)
                except Exception as exc:  # one bad job must not stop the others
                    result = JobFailed.of(exc)
                done(i, result)
            return results
        from distributed import as_completed

        token = uuid.uuid4().hex[:8]  # keys unique to this call: a cluster caches by key
        futures = {}
        grouped = tasks is not None and tasks < len(items)
        if grouped:
            for rank, members in enumerate(group_jobs(len(items), tasks, costs)):
                first = keys[members[0]] if keys is not None else members[0]
                key = f"{spec.desc}-{first}+{len(members) - 1}-{token}"
                args = [items[i] for i in members]
                future = client.submit(_run_group, func, args, key=key, pure=False, priority=-rank)
                futures[future] = members
        else:
            order = list(range(len(items)))
            if costs is not None:
                order.sort(key=lambda i: -costs[i])
            for rank, i in enumerate(order):
                key = f"{spec.desc}-{keys[i] if keys is not None else i}-{token}"
                future = client.submit(func, items[i], key=key, pure=False, priority=-rank)
                futures[future] = [i]
        for future in as_completed(futures):
            members = futures[future]
            try:
                result = future.result()
                outcome = result if grouped else [result]
            except Exception as exc:
                outcome = [JobFailed.of(exc)] * len(members)
            for i, r in zip(members, outcome, strict=True):
                done(i, r)
            future.release()
        return results
    finally:
        bar.close()


def group_jobs(count: int, n_groups: int, costs: Sequence[float] | None = None) -> list[list[int]]:
    """Indices ``0..count-1`` in ``n_groups`` groups (at most ``count``) of equal size give or
    take one, costliest groups first.

    With ``costs``, the jobs go costliest first into the group with the least cost so far
    (longest-processing-time first), so that the groups carry similar work; without, in
    consecutive runs.
    """
    if count <= 0:
        return []
    n_groups = min(max(int(n_groups), 1), count)
    size = -(-count // n_groups)
    if costs is None:
        bounds = [round(k * count / n_groups) for k in range(n_groups + 1)]
        return [list(range(a, b)) for a, b in zip(bounds, bounds[1:], strict=False)]
    import heapq

    order = sorted(range(count), key=lambda i: -costs[i])
    heap = [(0.0, g) for g in range(n_groups)]
    groups: list[list[int]] = [[] for _ in range(n_groups)]
    for i in order:
        load, g = heapq.heappop(heap)
        groups[g].append(i)
        if len(groups[g]) < size:  # a full group takes no more jobs
            heapq.heappush(heap, (load + float(costs[i]), g))
    groups = [sorted(g) for g in groups if g]
    groups.sort(key=lambda g: -sum(costs[i] for i in g))
    return groups


#: Cluster tasks per worker when small jobs are grouped (:func:`task_count`).
TASKS_PER_WORKER = 2
#: Most jobs in one grouped task (a lost worker reruns at most this many).
MAX_GROUP = 16


def task_count(client: Any, jobs: int) -> int:
    """How many cluster tasks to run ``jobs`` small jobs as: :data:`TASKS_PER_WORKER` per worker
    of ``client``'s cluster, more when that would put over :data:`MAX_GROUP` jobs in a task."""
    workers = max(len(client.scheduler_info().get("workers", {})), 1)
    return min(jobs, max(workers * TASKS_PER_WORKER, -(-jobs // MAX_GROUP)))


def _run_group(func: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``[func(item) ...]`` with a :class:`JobFailed` for each item that raised (one Dask task
    running several jobs: a bad job does not fail the others of its group)."""
    results = []
    for item in items:
        try:
            results.append(func(item))
        except Exception as exc:
            results.append(JobFailed.of(exc))
    return results


def describe(client: Any) -> str:
    """Where the jobs run, for logs: ``in this process`` or the scheduler and its workers."""
    if client is None:
        return "in this process"
    workers = len(client.scheduler_info().get("workers", {}))
    return f"on Dask scheduler {client.scheduler.address} with {workers} worker(s)"
