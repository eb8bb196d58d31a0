"""Small jobs grouped into fewer cluster tasks (data_prep.engine.group_jobs / map_jobs tasks)."""

from __future__ import annotations

import numpy as np
import pytest

from data_prep.engine import Bar, JobFailed, group_jobs, map_jobs, open_client, task_count


def _square_or_fail(x: int) -> int:
    if x == 7:
        raise ValueError("seven is refused")
    return x * x


@pytest.mark.parametrize("count,n_groups", [(1, 4), (10, 4), (33, 8), (33, 1), (5, 9)])
def test_groups_cover_every_job_once_in_near_equal_sizes(count, n_groups):
    groups = group_jobs(count, n_groups)
    assert sorted(i for g in groups for i in g) == list(range(count))
    assert len(groups) == min(n_groups, count)
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1


def test_groups_balance_their_costs():
    rng = np.random.default_rng(0)
    costs = rng.pareto(1.5, 40) + 0.1
    groups = group_jobs(40, 8, list(costs))
    assert sorted(i for g in groups for i in g) == list(range(40))
    assert max(len(g) for g in groups) <= 5
    loads = [costs[g].sum() for g in groups]
    assert loads == sorted(loads, reverse=True)  # costliest group first
    # greedy bound: no group exceeds the mean load by more than the costliest single job
    assert max(loads) <= costs.sum() / len(groups) + costs.max() + 1e-9
    # and the balance is better than consecutive runs of the same size
    plain = [costs[g].sum() for g in group_jobs(40, 8)]
    assert max(loads) - min(loads) < max(plain) - min(plain)


def _bookkeeping_settings():
    import dask

    return (
        dask.config.get("distributed.worker.profile.enabled"),
        dask.config.get("distributed.worker.memory.monitor-interval"),
    )


@pytest.mark.slow
def test_grouped_tasks_give_results_in_order_and_a_bad_job_fails_alone():
    seen = []
    with open_client(2) as client:
        assert task_count(client, 3) == 3
        assert task_count(client, 33) == 4  # 2 per worker
        assert task_count(client, 1000) == 63  # at most 16 jobs per task
        settings = client.run(_bookkeeping_settings)
        assert len(settings) == 2
        assert set(settings.values()) == {(False, "1s")}  # no profiler, memory polled each second
        results = map_jobs(
            _square_or_fail,
            list(range(12)),
            client=client,
            tasks=3,
            costs=list(range(12)),
            on_result=lambda i, r: seen.append(i),
            bar=Bar(show=False),
        )
    assert sorted(seen) == list(range(12))
    assert isinstance(results[7], JobFailed) and "seven is refused" in results[7].error
    assert [r for i, r in enumerate(results) if i != 7] == [i * i for i in range(12) if i != 7]


def test_tune_malloc_applies_on_glibc():
    import platform

    from data_prep.engine import tune_malloc

    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert tune_malloc() is glibc
    assert tune_malloc() is glibc  # idempotent
