"""The running app killed (SIGKILL) while analysts save corrections through its HTTP API: the
label store opens afterwards and holds every correction the app confirmed."""

from __future__ import annotations

import signal
import threading
import time

import pytest

from tests.conftest import app_process

ANALYSTS = ("c0", "c1", "c2", "c3")


@pytest.mark.slow
def test_kill_9_while_saving_keeps_every_confirmed_correction(score_model, synthetic_xbd, tmp_path):
    from gradio_client import Client, handle_file

    from app.web.users import add_user
    from data_prep.label_store import STORE_NAME, LabelStore
    from data_prep.synthetic import tile_name

    users = tmp_path / "users.txt"
    for name in ANALYSTS:
        add_user(users, name, f"pw-{name}")
    work = tmp_path / "work"
    options = ["--models", score_model.parent, "--model", score_model, "--users", users]
    with app_process(work, *options) as (proc, url):
        name = tile_name(0)
        files = [synthetic_xbd / "images" / f"{name}_pre_disaster.png",
                 synthetic_xbd / "images" / f"{name}_post_disaster.png",
                 synthetic_xbd / "labels" / f"{name}_post_disaster.json"]  # fmt: skip
        clients = {}
        for who in ANALYSTS:  # each analyst assesses the tile first
            clients[who] = Client(url, auth=(who, f"pw-{who}"), verbose=False)
            clients[who].predict(str(score_model.resolve()), *[handle_file(str(f)) for f in files],
                                 api_name="/assess_tile")  # fmt: skip
        confirmed: dict[str, list[int]] = {who: [] for who in ANALYSTS}

        def burst(who: str) -> None:
            for i in range(1000):
                try:
                    clients[who].predict(i % 5, "destroyed", api_name="/save_correction")
                except Exception:  # noqa: BLE001  (the server is gone)
                    return
                confirmed[who].append(i)

        threads = [threading.Thread(target=burst, args=(who,)) for who in ANALYSTS]
        for t in threads:
            t.start()
        while sum(map(len, confirmed.values())) < 40:
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        for t in threads:
            t.join(timeout=120)

    store = LabelStore(work / STORE_NAME)
    assert store.check() == "ok"
    rows = store.rows()
    for who in ANALYSTS:
        saved = [c for c in rows if c.analyst == who]
        # every confirmed save is there, in order (at most one more, in flight when killed)
        assert len(saved) >= len(confirmed[who]), (who, len(saved), len(confirmed[who]))
        assert [c.row for c in saved[: len(confirmed[who])]] == [i % 5 for i in confirmed[who]]
    assert sum(map(len, confirmed.values())) >= 40
