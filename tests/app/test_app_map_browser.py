"""The web app's pre/post slider and map in headless Chromium (the pattern of
tests/app/test_app_browser.py: Debian's /usr/bin/chromium, the app served on a free local port).

The app runs the bundled model. A georeferenced tile (the synthetic scene's west pre and post GeoTIFFs and its GeoJSON
footprints; the real Joplin tiles where ../shared/data is present) is assessed: after "Assess"
the slider shows the pre and post images and the map draws every building of the table, with
nothing fetched from outside the app. A building clicked on the map becomes the chosen building:
its ``#``, its chips and its row, marked in the table; a row clicked in the table is shown on the
map. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import re

import pytest

from tests.app.test_app_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, need_chromium, serve_app
from tests.conftest import REPO, missing, shared_data

#: The bundled model, as an analyst grades with it.
MODEL = REPO / "models" / "default.onnx"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The app on a free local port with the bundled model; yields its URL."""
    if not MODEL.is_file():
        missing(f"{MODEL} is missing: the bundled model ships with the project")
    yield from serve_app(MODEL, tmp_path_factory.mktemp("app"))


def _assess_and_pick(server, pre, post, footprints, shot: str) -> dict:
    """Assess a tile in the page, check the slider and the map, pick buildings both ways."""
    from playwright.sync_api import expect, sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 1800})
            outside: list[str] = []
            errors: list[str] = []
            page.on(
                "request",
                lambda r: (
                    None if r.url.startswith((server, "data:", "about:")) else outside.append(r.url)
                ),
            )
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(server, wait_until="domcontentloaded")
            expect(page.locator("#assess-tile")).to_be_visible(timeout=60_000)
            for elem, path in (("#tile-pre", pre), ("#tile-post", post), ("#tile-fp", footprints)):
                page.locator(f"{elem} input[type=file]").set_input_files(str(path))
                expect(page.locator(elem).get_by_text(path.stem).first).to_be_visible(
                    timeout=30_000
                )
            page.locator("#assess-tile").click()
            expect(page.locator("#summary")).to_contain_text("buildings", timeout=120_000)
            # the slider: the pre and the post image, both loaded
            page.wait_for_function(
                "() => { const i = [...document.querySelectorAll('#slider img')];"
                " return i.length >= 2 && i.every(x => x.complete && x.naturalWidth > 0); }",
                timeout=60_000,
            )
            # the map, in its frame, drawn
            expect(page.locator("#map iframe")).to_be_visible(timeout=60_000)
            frame = page.frame_locator("#map iframe")
            expect(frame.locator(".leaflet-container")).to_be_visible(timeout=30_000)
            inner = next(f for f in page.frames if f.url == "about:srcdoc")
            inner.wait_for_function("() => window.localDamage && localDamage.ready", timeout=30_000)
            shown = inner.evaluate(
                "() => ({drawn: localDamage.drawn, scored: localDamage.scored,"
                " paths: document.querySelectorAll('path.ld-building').length,"
                " geo: !!document.querySelector('.leaflet-control-scale')})"
            )
            # a graded building clicked on the map: the chosen building, in the table too
            # (a click by position: scrolling a path into view would move the map under it)
            page.locator("#map iframe").scroll_into_view_if_needed()
            box = frame.locator("path.ld-scored").first.bounding_box()
            page.mouse.click(box["x"] + box["width"] / 2, box["y"] + box["height"] / 2)
            frame.locator(".leaflet-popup-content").wait_for(timeout=10_000)
            row = inner.evaluate("() => localDamage.selected")
            assert row is not None
            expect(page.locator("#row input")).to_have_value(str(row), timeout=30_000)
            expect(page.locator("#bldg-details")).to_contain_text(
                f"Building #{row}", timeout=30_000
            )
            for elem in ("#bldg-pre img", "#bldg-post img"):
                expect(page.locator(elem)).to_be_visible(timeout=30_000)
            expect(page.locator("#buildings .ld-chosen .body-cell").first).to_have_text(
                str(row), timeout=10_000
            )
            page.screenshot(path=str(ARTIFACTS / shot), full_page=True)
            # a row clicked in the table (another one, from the top): shown on the map
            page.locator("#buildings .virtual-table-viewport").evaluate("e => e.scrollTop = 0")
            firsts = page.locator("#buildings .virtual-row .body-cell.first-column")
            expect(firsts.first).to_be_visible(timeout=10_000)
            numbers = [int(t) for t in firsts.all_inner_texts()[:5] if t.strip().isdigit()]
            other = next(n for n in numbers if n != row)
            page.locator("#buildings .virtual-row").filter(
                has=page.locator(
                    ".body-cell.first-column", has_text=re.compile(rf"^\s*{other}\s*$")
                )
            ).first.locator(".body-cell").nth(2).click()
            expect(page.locator("#row input")).to_have_value(str(other), timeout=30_000)
            inner.wait_for_function(f"() => localDamage.selected === {other}", timeout=30_000)
            expect(page.locator("#bldg-details")).to_contain_text(
                f"Building #{other}", timeout=30_000
            )
            # a correction saved in the page: shown on the map at once, in the details with
            # its analyst, and in the table's corrected/by columns
            page.locator("#right-class input").click()
            page.get_by_role("option", name="destroyed", exact=True).click()
            page.locator("#save-correction").click()
            expect(page.locator("#correct-msg")).to_contain_text(
                f"building #{other} is destroyed (by anonymous)", timeout=30_000
            )
            inner.wait_for_function(
                f"() => localDamage.layer({other}).feature.properties.corrected === 'destroyed'",
                timeout=30_000,
            )
            assert frame.locator('path[stroke-dasharray="4 3"]').count() == 1  # dashed outline
            expect(page.locator("#bldg-details")).to_contain_text(
                "Corrected: destroyed by anonymous", timeout=30_000
            )
            expect(page.locator("#buildings")).to_contain_text("anonymous", timeout=30_000)
            assert not outside, f"the page fetched from outside the app: {outside[:5]}"
            assert not errors, errors
            return shown
        finally:
            browser.close()


@pytest.mark.browser
def test_slider_and_map_after_assess(server, synthetic_scene):
    need_chromium()
    s = synthetic_scene
    shown = _assess_and_pick(server, s.pre[0], s.post[0], s.buildings, "app_map.png")
    assert shown["drawn"] == shown["paths"] == s.n_buildings
    assert 0 < shown["scored"] < s.n_buildings  # the west tile only: the rest not covered
    assert shown["geo"]  # georeferenced: on Web Mercator, with a scale in metres


@pytest.mark.browser
@pytest.mark.realdata
def test_slider_and_map_on_a_joplin_tile(server):
    """One real Joplin pre tile, the post tile over half of it and the Microsoft footprints."""
    need_chromium()
    root = shared_data("joplin_geotiff")
    pre = root / "pre" / "tile_337-9136.tif"
    post = root / "post" / "tile_31500-5137.tif"
    shown = _assess_and_pick(
        server, pre, post, root / "footprints" / "joplin.geojson", "app_map_joplin.png"
    )
    assert shown["scored"] > 10 and shown["drawn"] == shown["paths"]


@pytest.mark.browser
@pytest.mark.realdata
def test_slider_and_map_on_an_xbd_tile(server):
    """A real xBD tile pair with its label JSON: the map in image pixels, no scale in metres."""
    need_chromium()
    root = shared_data("xbd_sample")
    stem = "hurricane-florence_00000318"
    pre = root / "images" / f"{stem}_pre_disaster.png"
    post = root / "images" / f"{stem}_post_disaster.png"
    labels = root / "labels" / f"{stem}_post_disaster.json"
    shown = _assess_and_pick(server, pre, post, labels, "app_map_xbd.png")
    assert shown["scored"] > 5 and shown["drawn"] == shown["paths"]
    assert not shown["geo"]
