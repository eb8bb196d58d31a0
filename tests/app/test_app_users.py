"""Several analysts: the users file, logging in to the running app, and each correction saved
through the app's HTTP API recorded with its analyst."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest


def test_users_file_round_trip_and_errors(tmp_path):
    from app.web.sessions import AppError
    from app.web.users import Users, add_user, read_users, verify

    path = tmp_path / "users.txt"
    assert add_user(path, "ana", "correct horse") is True
    assert add_user(path, "ben", "battery staple") is True
    assert add_user(path, "ana", "new one") is False  # a new password, not a second ana
    users = read_users(path)
    assert list(users) == ["ana", "ben"]
    assert "new one" not in path.read_text() and "battery" not in path.read_text()
    assert verify("new one", users["ana"]) and not verify("correct horse", users["ana"])
    login = Users(path)
    assert login("ben", "battery staple") and not login("ben", "wrong") and not login("cat", "x")
    add_user(path, "cat", "tabby")  # added during the campaign: no restart needed
    assert login("cat", "tabby")

    with pytest.raises(AppError, match="analyst name"):
        add_user(path, "a b", "x")
    with pytest.raises(AppError, match="password is empty"):
        add_user(path, "dan", "")
    bad = tmp_path / "bad.txt"
    bad.write_text("# analysts\nana:plaintext\n")
    with pytest.raises(AppError, match=r"bad.txt, line 2: expected name:scrypt"):
        read_users(bad)
    bad.write_text(path.read_text() + path.read_text().splitlines()[1] + "\n")
    with pytest.raises(AppError, match="listed twice"):
        read_users(bad)
    with pytest.raises(AppError, match="missing.txt"):
        Users(tmp_path / "missing.txt")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def campaign(score_model, synthetic_xbd, tmp_path_factory):
    """The app with a users file of two analysts, serving on a free port: (url, work folder)."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from app.web.app import ServeOptions, launch
    from app.web.users import Users, add_user

    root = tmp_path_factory.mktemp("campaign")
    users = root / "users.txt"
    add_user(users, "ana", "pw-ana")
    add_user(users, "ben", "pw-ben")
    port = _free_port()
    work = root / "work"
    demo = launch(
        models_dir=score_model.parent, model=str(score_model), work_dir=work,
        serve=ServeOptions(port=port, block=False, auth=Users(users)),
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}/", work
    finally:
        demo.close()


def _tile(synthetic_xbd) -> list[Path]:
    from data_prep.synthetic import tile_name

    name = tile_name(0)
    images = synthetic_xbd / "images"
    return [images / f"{name}_pre_disaster.png", images / f"{name}_post_disaster.png",
            synthetic_xbd / "labels" / f"{name}_post_disaster.json"]  # fmt: skip


@pytest.mark.slow
def test_each_analyst_logs_in_and_corrections_record_who(campaign, score_model, synthetic_xbd):
    from gradio_client import Client, handle_file

    from data_prep.label_store import STORE_NAME, LabelStore

    url, work = campaign
    with pytest.raises(Exception, match="(?i)login|credentials|auth|401|403"):
        Client(url, auth=("ana", "wrong"), verbose=False)
    files = [handle_file(str(p)) for p in _tile(synthetic_xbd)]
    tables = {}
    for name in ("ana", "ben"):
        client = Client(url, auth=(name, f"pw-{name}"), verbose=False)
        _, _, table, _ = client.predict(str(score_model.resolve()), *files, api_name="/assess_tile")
        tables[name] = table
        row = 0 if name == "ana" else 1
        message, _ = client.predict(row, "destroyed", api_name="/save_correction")
        assert f"by {name}" in message
    rows = LabelStore(work / STORE_NAME).rows()
    assert [(c.analyst, c.row, c.grade) for c in rows] == [
        ("ana", 0, "destroyed"), ("ben", 1, "destroyed"),
    ]  # fmt: skip
    # ben's assessment of the same tile shows ana's correction and who set it
    headers = tables["ben"]["headers"]
    first = dict(zip(headers, tables["ben"]["data"][0], strict=True))
    assert first["corrected"] == "destroyed" and first["by"] == "ana"
