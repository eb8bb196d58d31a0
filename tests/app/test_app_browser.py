"""The running web app: driven in headless Chromium, and called through `gradio_client`.

The browser test needs Debian's ``chromium`` at /usr/bin/chromium (``.ci/run`` installs it):
without it the test skips with a message, or fails where ``CI`` is set. It uploads a synthetic
1024 x 1024 xBD-format tile with 150 buildings, clicks "Assess", checks the overlay and the table,
prints the time from the click to the overlay and saves a screenshot to
``test-artifacts/app_browser.png``. It then corrects two buildings, clicks "Adapt" (the picker
gains and chooses the adapted model, the tile is graded again with it) and "Suggest next", and
prints the time from the Adapt click to the new overlay.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import socket
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, missing, shared_data

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ARTIFACTS = REPO / "test-artifacts"
#: Buildings on the benchmark tile.
N_BUILDINGS = 150


def need_chromium() -> None:
    """Skip the test without Chromium (fail in CI, where ``.ci/run`` installs it)."""
    if not CHROMIUM.is_file():
        missing(f"{CHROMIUM} not found: install Debian's chromium (apt-get install chromium)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scroll_table_to(page, row: int, timeout: float = 15_000) -> None:
    """Scroll the buildings table to its end until the cell of ``row`` is rendered: the table
    draws only the rows in view, and its height grows as it draws them, so one scroll to the end
    may stop short of the last row."""
    page.wait_for_function(
        "(t) => { document.querySelectorAll('#buildings *').forEach(e => {"
        " if (e.scrollHeight > e.clientHeight + 5) e.scrollTop = e.scrollHeight; });"
        " return [...document.querySelectorAll('#buildings [role=gridcell]')]"
        ".some(c => c.textContent.trim() === t); }",
        arg=str(row),
        timeout=timeout,
    )


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory) -> Path:
    """ResNet-18 at 128 px input, one epoch on synthetic xBD, exported with the change map as
    ``models/resnet18-128.onnx`` and, static int8, as ``models/resnet18-128-int8.onnx``.

    The weights barely matter for speed; the architecture and input size are those of a
    realistic small model. Returns the fp32 model.
    """
    from data_prep.split import make_splits
    from data_prep.synthetic import make_xbd
    from data_prep.xbd import prepare_xbd
    from local_damage.config import load_yaml
    from local_damage.export.model import export_run
    from local_damage.export.options import ExportOptions
    from local_damage.train.config import Config
    from local_damage.train.loaders import ChipSplit
    from local_damage.train.loop import train

    root = tmp_path_factory.mktemp("bench_model")
    make_xbd(root / "xbd", seed=1)
    prepare_xbd([root / "xbd"], root / "chips", progress=False)
    make_splits(root / "chips", folds=3)
    overrides = [
        "model.encoder=resnet18",
        "train.epochs=1",
        "train.batch_size=8",
        "data.input_size=128",
    ]
    split = ChipSplit(fold=0)
    train(load_yaml(Config, None, overrides), root / "chips", root / "run", split, progress=False)
    out = root / "models" / "resnet18-128.onnx"
    export_run(root / "run", out, ExportOptions(parity_limit=16, change_map=True))
    export_run(
        root / "run",
        out.with_name("resnet18-128-int8.onnx"),
        ExportOptions(quantize="int8", parity_limit=16, calibration_limit=32, change_map=True),
    )
    bundled = REPO / "models" / "default.onnx"
    if bundled.is_file():  # the shipped model, timed too: the target is stated for it
        shutil.copy(bundled, out.parent / bundled.name)
    return out


@pytest.fixture(scope="module")
def bench_tile(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(pre, post, label) of a synthetic 1024 x 1024 tile trimmed to 150 buildings."""
    from data_prep.synthetic import make_xbd, tile_name

    root = tmp_path_factory.mktemp("bench_tile")
    make_xbd(root, seed=0, n_tiles=1, size=1024)
    name = tile_name(0)
    label = root / "labels" / f"{name}_post_disaster.json"
    data = json.loads(label.read_text())
    xy = data["features"]["xy"][:N_BUILDINGS]
    assert len(xy) == N_BUILDINGS, "the synthetic tile has fewer buildings than the benchmark needs"
    keep = {f["properties"]["uid"] for f in xy}
    data["features"]["xy"] = xy
    data["features"]["lng_lat"] = [
        f for f in data["features"]["lng_lat"] if f["properties"]["uid"] in keep
    ]
    label.write_text(json.dumps(data))
    images = root / "images"
    return images / f"{name}_pre_disaster.png", images / f"{name}_post_disaster.png", label


def serve_app(model, work_dir):
    """The app serving ``model`` (and the models beside it) on a free local port; yields its URL
    and stops it after."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    from app.web.app import ServeOptions, launch

    port = _free_port()
    demo = launch(
        models_dir=model.parent,
        model=str(model),
        work_dir=work_dir,
        serve=ServeOptions(port=port, block=False),
    )
    try:
        yield f"http://127.0.0.1:{port}/"
    finally:
        demo.close()


@pytest.fixture(scope="module")
def server(bench_model, tmp_path_factory):
    """The app serving on a free local port; yields its URL."""
    yield from serve_app(bench_model, tmp_path_factory.mktemp("app"))


@pytest.mark.browser
def test_browser_assess_tile(server, bench_model, bench_tile):
    need_chromium()
    from playwright.sync_api import expect, sync_playwright

    pre, post, label = bench_tile
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            external: list[str] = []  # the page must work offline: nothing beyond the app
            page.on(
                "request",
                lambda r: (
                    None
                    if r.url.startswith(server) or r.url.startswith("data:")
                    else external.append(r.url)
                ),
            )
            page.goto(server, wait_until="domcontentloaded")
            expect(page.locator("#assess-tile")).to_be_visible(timeout=60_000)
            for elem, path in (("#tile-pre", pre), ("#tile-post", post), ("#tile-fp", label)):
                page.locator(f"{elem} input[type=file]").set_input_files(str(path))
                expect(page.locator(elem).get_by_text(path.stem).first).to_be_visible(
                    timeout=30_000
                )
            seconds = _assess(page, "resnet18-128")
            summary = page.locator("#summary")
            expect(summary).to_contain_text(f"{N_BUILDINGS} buildings", timeout=30_000)
            table = page.locator("#buildings")
            expect(table.get_by_role("columnheader", name="confidence")).to_be_visible()
            first = table.get_by_role("gridcell", name="0", exact=True)
            expect(first).to_be_visible()
            # the table renders the rows in view: scroll to its end for the last building
            scroll_table_to(page, N_BUILDINGS - 1)
            last = table.get_by_role("gridcell", name=str(N_BUILDINGS - 1), exact=True)
            expect(last).to_be_visible(timeout=10_000)
            assert table.get_by_role("gridcell", name=str(N_BUILDINGS), exact=True).count() == 0
            size = page.evaluate(
                "() => [document.querySelector('#overlay img').naturalWidth,"
                " document.querySelector('#overlay img').naturalHeight]"
            )
            assert size[0] == 1024 and size[1] > 1024  # the tile and the legend band below it
            last.click()  # selecting a building shows its chips
            for elem in ("#bldg-pre img", "#bldg-post img"):
                expect(page.locator(elem)).to_be_visible(timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "app_browser.png"), full_page=True)

            # the same tile with the int8 model, chosen in the model picker
            page.locator("#model input").click()
            page.get_by_role("option", name="resnet18-128-int8.onnx").click()
            expect(page.get_by_text("int8, 128 px input")).to_be_visible(timeout=30_000)
            seconds_int8 = _assess(page, "resnet18-128-int8")
            expect(summary).to_contain_text(f"{N_BUILDINGS} buildings", timeout=30_000)

            # correct two buildings, Adapt the int8 model: the picker gains the adapted model and
            # chooses it, and the tile is graded again with it
            for row, grade in ((0, "destroyed"), (1, "no-damage")):
                page.locator("#row input").fill(str(row))
                page.locator("#row input").press("Enter")
                page.locator("#right-class input").click()
                page.get_by_role("option", name=grade, exact=True).click()
                page.locator("#save-correction").click()
                expect(page.locator("#correct-msg")).to_contain_text(
                    f"building #{row} is {grade}", timeout=30_000
                )
            expect(page.locator("#event input")).to_have_value("synthetic-flood")
            adapted = "synthetic-flood-adapted-1"
            start = time.perf_counter()
            page.locator("#adapt").click()
            expect(page.locator("#adapt-status")).to_contain_text(
                "Adapted to 2 corrected buildings of event synthetic-flood", timeout=120_000
            )
            expect(summary).to_contain_text(f"with {adapted}.", timeout=30_000)
            seconds_adapt = time.perf_counter() - start
            expect(page.locator("#model input")).to_have_value(f"{adapted}.onnx")
            expect(page.get_by_text("adapted to a new event: yes")).to_be_visible()
            expect(page.locator("#adapt-status")).to_contain_text("destroyed 1")
            # Suggest: the uncorrected buildings to correct next; clicking one shows its chips
            page.locator("#suggest").click()
            suggestions = page.locator("#suggestions")
            expect(suggestions.get_by_role("columnheader", name="uncertainty")).to_be_visible()
            expect(suggestions.get_by_role("gridcell", name="1", exact=True).first).to_be_visible(
                timeout=30_000
            )
            cells = suggestions.get_by_role("row").nth(1).get_by_role("gridcell")
            picked = cells.nth(1).inner_text().strip()  # its # in the building table
            assert picked not in ("0", "1")  # the corrected buildings are not suggested
            cells.nth(0).click()
            expect(page.locator("#row input")).to_have_value(picked, timeout=30_000)
            page.screenshot(path=str(ARTIFACTS / "app_browser_adapt.png"), full_page=True)
            later = browser.new_page()  # a page opened later offers the adapted model too
            later.goto(server, wait_until="domcontentloaded")
            later.locator("#model input").click()
            expect(later.get_by_role("option", name=f"{adapted}.onnx")).to_be_visible(
                timeout=30_000
            )
            later.close()

            timings = [("ResNet-18 128 px fp32", seconds), ("ResNet-18 128 px int8", seconds_int8)]
            timings.append(("Adapt (2 corrections) + grading again, int8", seconds_adapt))

            default = bench_model.parent / "default.onnx"
            if default.is_file():  # the bundled default model, as a newcomer gets it
                from runtime.predictor import Predictor

                card = Predictor(default).card()
                page.locator("#model input").click()
                page.get_by_role("option", name="default.onnx").click()
                expect(
                    page.get_by_text(f"{card['precision']}, {card['input_size']} px input")
                ).to_be_visible(timeout=30_000)
                timings.append(("bundled default.onnx", _assess(page, "default")))
                expect(summary).to_contain_text(f"{N_BUILDINGS} buildings", timeout=30_000)
                page.screenshot(path=str(ARTIFACTS / "app_browser_default.png"), full_page=True)
            assert not external, f"the page fetched from outside the app: {external[:5]}"
        finally:
            browser.close()
    for name, s in timings:
        print(
            f"\nweb app: {N_BUILDINGS} buildings on a 1024x1024 tile, {name}, "
            f"click to overlay {s:.2f} s ({os.cpu_count()} CPU cores)"
        )


@pytest.mark.browser
def test_browser_assess_tile_without_footprints(server, bench_model, bench_tile):
    """Pre and post only: the localiser of the models folder finds the buildings, and they are
    graded, drawn and listed like given ones."""
    need_chromium()
    from playwright.sync_api import expect, sync_playwright

    from runtime.localizer import Localizer
    from runtime.registry import LOCALIZER_NAME
    from tests.app.rects import make_localizer

    pre, post, _ = bench_tile
    # a brightness localiser (a real ONNX graph): the synthetic roofs are brighter than the ground
    localizer = make_localizer(bench_model.parent / LOCALIZER_NAME, level=140.0, min_area_px=30)
    expected = len(Localizer(localizer).detect(_rgb(pre)))
    assert expected > 10
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            page.goto(server, wait_until="domcontentloaded")
            expect(page.locator("#assess-tile")).to_be_visible(timeout=60_000)
            for elem, path in (("#tile-pre", pre), ("#tile-post", post)):
                page.locator(f"{elem} input[type=file]").set_input_files(str(path))
                expect(page.locator(elem).get_by_text(path.stem).first).to_be_visible(
                    timeout=30_000
                )
            start = time.perf_counter()
            page.locator("#assess-tile").click()
            summary = page.locator("#summary")
            expect(summary).to_contain_text("buildings detected by the localiser", timeout=120_000)
            seconds = time.perf_counter() - start
            expect(summary).to_contain_text(f"{expected} buildings")
            table = page.locator("#buildings")
            expect(table.get_by_role("columnheader", name="confidence")).to_be_visible()
            expect(table.get_by_role("gridcell", name="0", exact=True)).to_be_visible()
            scroll_table_to(page, expected - 1)
            last = table.get_by_role("gridcell", name=str(expected - 1), exact=True)
            expect(last).to_be_visible(timeout=10_000)
            assert table.get_by_role("gridcell", name=str(expected), exact=True).count() == 0
            page.screenshot(path=str(ARTIFACTS / "app_browser_detected.png"), full_page=True)
        finally:
            browser.close()
            localizer.unlink()
    print(
        f"\nweb app: {expected} detected buildings on a 1024x1024 tile, brightness localiser, "
        f"click to summary {seconds:.2f} s ({os.cpu_count()} CPU cores)"
    )


def _rgb(path: Path):
    from data_prep.imagery import read_rgb

    return read_rgb(path)


def _assess(page, model: str) -> float:
    """Click "Assess" and wait until the summary names ``model`` and the overlay image is
    loaded; returns the seconds from the click. Then wait for the ``#`` box to be emptied (what
    follows an assessment: a building typed there before would be cleared)."""
    start = time.perf_counter()
    page.locator("#assess-tile").click()
    page.wait_for_function(
        "(model) => { const i = document.querySelector('#overlay img');"
        " const s = document.querySelector('#summary');"
        " return s && s.textContent.includes('with ' + model + '.')"
        " && i && i.complete && i.naturalWidth > 0; }",
        arg=model,
        timeout=120_000,
    )
    seconds = time.perf_counter() - start
    page.wait_for_function(
        "() => document.querySelector('#row input').value === ''", timeout=30_000
    )
    return seconds


@pytest.mark.slow
def test_gradio_client_assess_tile(server, bench_model, bench_tile):
    from gradio_client import Client, handle_file

    pre, post, label = bench_tile
    client = Client(server, verbose=False)
    overlay, summary, table, files = client.predict(
        str(bench_model.resolve()),
        handle_file(str(pre)),
        handle_file(str(post)),
        handle_file(str(label)),
        api_name="/assess_tile",
    )
    assert Path(overlay).is_file()
    assert f"**{N_BUILDINGS} buildings**" in summary
    assert len(table["data"]) == N_BUILDINGS
    assert "confidence" in table["headers"]
    assert sorted(Path(f).suffix for f in files) == [".csv", ".geojson"]


@pytest.mark.slow
def test_gradio_client_bad_input_keeps_serving(server, bench_model, bench_tile, tmp_path):
    from gradio_client import Client, handle_file
    from gradio_client.exceptions import AppError

    pre, post, label = bench_tile
    junk = tmp_path / "junk.png"
    junk.write_text("not an image")
    client = Client(server, verbose=False)
    with pytest.raises(AppError, match=r"junk\.png: not a readable image"):
        client.predict(
            str(bench_model.resolve()),
            handle_file(str(junk)),
            handle_file(str(post)),
            handle_file(str(label)),
            api_name="/assess_tile",
        )
    import cv2

    tile = cv2.imread(str(pre))
    chip_pre, chip_post = tmp_path / "c_pre.png", tmp_path / "c_post.png"
    cv2.imwrite(str(chip_pre), tile[100:164, 100:164])
    cv2.imwrite(str(chip_post), cv2.imread(str(post))[100:164, 100:164])
    probs, heatmap, note = client.predict(  # the app still serves after the error
        str(bench_model.resolve()),
        handle_file(str(chip_pre)),
        handle_file(str(chip_post)),
        api_name="/assess_chip",
    )
    assert {c["label"] for c in probs["confidences"]} == {
        "no-damage",
        "minor-damage",
        "major-damage",
        "destroyed",
    }
    assert Path(heatmap).is_file() and "feature-correlation map" in note


@pytest.mark.realdata
def test_real_xbd_tile_assessed(score_model, tmp_path):
    """A real xBD tile from ../shared/data/xbd_sample through the tile-mode function."""
    from app.web.app import assess_tile
    from runtime.predictor import Predictor

    root = shared_data("xbd_sample")
    labels = sorted(root.rglob("*_post_disaster.json"))
    if not labels:
        missing(f"{root}: no *_post_disaster.json label files")
    label = labels[0]
    name = label.name.replace("_post_disaster.json", "")
    images = {p.name: p for p in root.rglob(f"{name}_*_disaster.*") if p.suffix != ".json"}
    pre = next((p for n, p in images.items() if "_pre_" in n), None)
    post = next((p for n, p in images.items() if "_post_" in n), None)
    if pre is None or post is None:
        missing(f"{label}: images of tile {name} not found")
    xy = json.loads(label.read_text())["features"]["xy"]
    uids = [
        f["properties"]["uid"]
        for f in xy
        if f["properties"].get("feature_type", "building") == "building"
    ]
    r = assess_tile(Predictor(score_model), pre, post, label, tmp_path / "s")
    # every building of the label, in its order, in the table and the CSV
    assert r.buildings == len(uids) > 0
    assert [row["uid"] for row in r.rows] == uids
    with open(r.csv, newline="") as fh:
        assert [row["uid"] for row in csv.DictReader(fh)] == uids
    # the counts are those of the graded rows, and some were graded
    scored = [row["damage"] for row in r.rows if row["status"] == "scored"]
    assert scored and r.counts == {c: scored.count(c) for c in r.class_names}
    # the overlay is the tile (1024 px wide) with the legend band below it
    import cv2

    overlay = cv2.imread(str(r.overlay))
    assert overlay is not None and overlay.shape[1] == 1024 and overlay.shape[0] > 1024
