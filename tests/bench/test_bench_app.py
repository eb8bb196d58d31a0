"""`local-damage bench app`: the app served in its own process and driven through its HTTP API
by concurrent clients, small: the bundled model, one synthetic tile, two clients."""

from __future__ import annotations

import json

import pytest

from bench.app_load import MAX_CLIENTS, MAX_TILES
from tests.conftest import run_cli


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_app_small_run_is_consistent(capsys):
    argv = ["bench", "app", "--clients", "2", "--tiles", "1", "--corrections", "1"]
    assert run_cli(*argv, "--tile-size", "256", "--timeout", "90", "--json") == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["url"].startswith("http://127.0.0.1:")
    assert "synthetic" in result["tiles"] and len(result["tile_names"]) == 1
    assert result["limits"]["concurrency_limit"] >= 1 and result["limits"]["queue_size"] >= 1
    assert result["machine"]["cpus"] >= 1
    base, load = result["levels"]
    assert base["baseline"] and base["clients"] == 1 and not load["baseline"]
    assert load["clients"] == 2
    for level, sent in ((base, 1), (load, 2)):
        assert level["sent"] == sent and level["not_sent"] == 0
        assert level["answered"] == level["sent"] - level["refused"] - level["failed"]
        assert level["answered"] == sent, level["errors"]
        assert level["p95_s"] >= level["p50_s"] > 0
        assert level["max_s"] >= level["p95_s"]
        assert level["per_s"] > 0 and level["memory_peak_mib"] > 0
    assert base["p50_ratio"] == pytest.approx(1.0) and load["p50_ratio"] > 0
    server = result["server"]
    assert server["memory_peak_mib"] >= server["memory_start_mib"] > 0
    # every assessment of the tile (the untimed first one included) gave the same grades
    assert result["grades"] == {"tiles": 1, "assessments": 4, "differing": []}
    assert not result["time_limit_reached"]
    if result["corrections_endpoint"]:
        fixes = [level["corrections"] for level in (base, load)]
        assert [f["acknowledged"] for f in fixes] == [1, 2]
        assert [f["kept"] for f in fixes] == [1, 2]
        assert result["store"]["rows"] == 3
    # one progress line per assessment on standard error
    assert captured.err.count("answered in") == 3


def test_bench_app_prints_a_table(capsys):
    from bench.app_load import format_result

    level = {
        "level": "baseline", "clients": 1, "tiles": 1, "sent": 1, "answered": 1, "refused": 0,
        "failed": 0, "not_sent": 0, "p50_s": 1.0, "p95_s": 1.0, "max_s": 1.0, "per_s": 0.5,
        "memory_peak_mib": 400.0, "baseline": True, "p50_ratio": 1.0, "per_s_ratio": 1.0,
        "errors": [], "corrections": {"acknowledged": 0, "refused": 0, "failed": 0, "kept": None,
                                      "answered": 0, "p50_s": None},
    }  # fmt: skip
    result = {
        "model": "default.onnx", "tiles": "synthetic tile(s)", "tile_names": ["t"],
        "corrections_per_assessment": 2, "timeout_s": 600, "url": "http://127.0.0.1:1/",
        "time_limit_reached": False, "limits": {"concurrency_limit": 2, "queue_size": 32},
        "machine": {"cpus": 2, "cpu_model": "cpu", "memory_gib": 8.0},
        "server": {"startup_s": 5.0, "memory_start_mib": 300.0, "memory_after_warmup_mib": 350.0,
                   "memory_peak_mib": 400.0, "warmup_s": 2.0},
        "corrections_endpoint": False, "levels": [level],
        "grades": {"tiles": 1, "assessments": 2, "differing": []}, "store": {"rows": None},
    }  # fmt: skip
    text = format_result(result)
    assert "corrections: not measured (the app has no save_correction endpoint)" in text
    assert "CONCURRENCY_LIMIT 2" in text and "QUEUE_SIZE 32" in text  # as in the result
    assert "baseline*" in text and "1.00x" in text


@pytest.mark.parametrize(
    ("option", "message"),
    [
        (["--host", "0.0.0.0"], "--host 0.0.0.0: the app is served on 127.0.0.1 or localhost only"),
        (["--clients", str(MAX_CLIENTS + 1)], f"--clients must be between 1 and {MAX_CLIENTS}"),
        (["--clients", "4,0"], f"--clients must be between 1 and {MAX_CLIENTS}"),
        (["--tiles", str(MAX_TILES + 1)], f"--tiles must be between 1 and {MAX_TILES}"),
    ],
)
def test_bench_app_refuses_bad_settings_before_starting(option, message, capsys):
    assert run_cli("bench", "app", *option) == 2
    err = capsys.readouterr().err
    assert f"error: {message}" in err
    assert "answered in" not in err  # refused before the app was started
