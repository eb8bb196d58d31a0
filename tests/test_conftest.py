"""The suite's own rules: in CI (``CI`` set) a missing data set or Chromium fails the run; elsewhere
the tests that need them skip. Checked by running pytest on a small test file in a subprocess."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO, SHARED_DATA

NEEDS = """
from pathlib import Path

import tests.app.test_app_browser as browser
from tests.conftest import shared_data


def test_needs_real_data():
    shared_data("no-such-data-set")


def test_needs_chromium():
    browser.CHROMIUM = Path("/nonexistent/chromium")
    browser.need_chromium()
"""


@pytest.mark.slow
@pytest.mark.parametrize("ci", [None, "true", "1"])
def test_missing_data_and_chromium_fail_in_ci_and_skip_elsewhere(tmp_path, ci):
    (tmp_path / "test_needs.py").write_text(NEEDS)
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if ci is not None:
        env["CI"] = ci
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-rsf", "-p", "no:cacheprovider", "test_needs.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert f"{SHARED_DATA / 'no-such-data-set'} not present" in out, out[-3000:]
    assert "/nonexistent/chromium not found" in out, out[-3000:]
    if ci is None:
        assert done.returncode == 0 and "2 skipped" in out and "failed" not in out, out[-3000:]
    else:
        assert done.returncode == 1 and "2 failed" in out, out[-3000:]
        for name in ("test_needs_real_data", "test_needs_chromium"):
            assert f"FAILED test_needs.py::{name} - Failed: " in out, out[-3000:]
        assert "CI is set, so this test must run" in out


@pytest.mark.parametrize("value", ["", "0", "false", "no"])
def test_ci_unset_by_its_usual_spellings(monkeypatch, value):
    from tests.conftest import in_ci

    monkeypatch.setenv("CI", value)
    assert not in_ci()
    monkeypatch.setenv("CI", "true")
    assert in_ci()


HANGS = """
import os


def test_hangs_in_c_code():
    os.system("sleep 40")  # C's system() waits for its child through any signal
"""


@pytest.mark.slow
def test_a_hung_test_ends_the_run_as_a_failure(tmp_path):
    """The suite's timeout (pyproject.toml) ends a run whose test hangs in C code, deaf to
    signals, at once and as a failure; the limit is lowered to 2 s here, the method is the suite's
    (with SIGALRM the run would wait for the C call to return)."""
    (tmp_path / "test_hangs.py").write_text(HANGS)
    argv = [sys.executable, "-m", "pytest", "-c", str(REPO / "pyproject.toml"), "-o", "timeout=2",
            "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_hangs.py")]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out = proc.communicate(timeout=30)[0]
    finally:  # the sleep of the hung test, and the run if it still waits
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode != 0 and "Timeout" in out, out[-3000:]
