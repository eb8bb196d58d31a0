"""The web map of real scenes in headless Chromium, with every request outside the file blocked.

The Joplin GeoTIFFs (../shared/data/joplin_geotiff) and a real xBD tile (../shared/data/
xbd_sample) are scored with the bundled model and ``--map``; the map file is opened from disk in
Chromium (Debian's, /usr/bin/chromium, as tests/app/test_app_browser.py) with a route that aborts
any request that is not the file itself or a ``data:`` URI. The map must draw every building of
the vector output, every graded one coloured, with no page error and no request outside the
file; a click on a building gives its grade and probabilities as the vector output has them;
switching to the pre imagery shows it; switching the online basemap on tries the network (the
requests are blocked) and the page keeps working. Screenshots go to ``test-artifacts/``.
"""

from __future__ import annotations

import json

import pytest

from tests.app.test_app_browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, need_chromium
from tests.conftest import REPO, missing, run_cli, shared_data

#: The bundled model, as a user scores with it.
MODEL = REPO / "models" / "default.onnx"


def _model():
    if not MODEL.is_file():
        missing(f"{MODEL} is missing: the bundled model ships with the project")
    return MODEL


class OfflinePage:
    """A Chromium page that may load its file and ``data:`` URIs only; it records what else it
    asked for (blocked), page errors and console errors (those of a blocked request aside)."""

    def __init__(self, browser):
        self.page = browser.new_page(viewport={"width": 1200, "height": 900})
        self.blocked: list[str] = []
        self.errors: list[str] = []
        self.page.route("**/*", self._route)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))
        self.page.on(
            "console",
            lambda m: (
                self.errors.append(f"console: {m.text}")
                if m.type == "error" and "Failed to load resource" not in m.text
                else None
            ),
        )

    def _route(self, route):
        url = route.request.url
        if url.startswith(("file://", "data:")):
            route.continue_()
        else:
            self.blocked.append(url)
            route.abort()

    def open(self, path) -> float:
        """Open a map file and wait until it says it is drawn; the milliseconds it took."""
        self.page.goto(path.resolve().as_uri())
        self.page.wait_for_function("() => window.localDamage && localDamage.ready", timeout=60_000)
        return self.page.evaluate("() => localDamage.renderMs")


def _score(tmp_path, *inputs) -> tuple:
    out, html = tmp_path / "scene.geojson", tmp_path / "scene.html"
    rc = run_cli("score", *inputs, "--model", _model(), "--out", out, "--map", html, "--quiet")
    assert rc == 0
    return out, html


def _check_drawn(page, vector) -> dict:
    """Every building of the vector output drawn; the graded ones coloured by grade."""
    import geopandas as gpd

    df = gpd.read_file(vector)
    shown = page.evaluate(
        "() => ({drawn: localDamage.drawn, scored: localDamage.scored,"
        " paths: document.querySelectorAll('path.ld-building').length,"
        " graded: document.querySelectorAll('path.ld-scored').length,"
        " flagged: document.querySelectorAll('path.ld-flagged').length,"
        " colours: [...document.querySelectorAll('path.ld-scored')].map(p =>"
        "   p.getAttribute('fill'))})"
    )
    scored = df[df["status"] == "scored"]
    assert len(scored) > 0
    assert shown["drawn"] == shown["paths"] == int(df.geometry.notna().sum())
    assert shown["scored"] == shown["graded"] == len(scored)
    assert shown["flagged"] == int((df["flags"].fillna("") != "").sum())
    from app.scoring.outputs import CLASS_COLOURS

    palette = {"#" + "".join(f"{v:02x}" for v in c) for c in CLASS_COLOURS}
    assert set(shown["colours"]) <= palette
    return {"df": df, "scored": scored}


def _click_building(page, df, row: int) -> str:
    """Click building ``row`` where it is drawn; the text of the details that open."""
    page.evaluate(f"() => localDamage.map.fitBounds(localDamage.layer({row}).getBounds())")
    box = page.evaluate(
        f"() => {{ const r = localDamage.layer({row}).getElement().getBoundingClientRect();"
        " return [r.x + r.width / 2, r.y + r.height / 2]; }"
    )
    page.mouse.click(*box)
    popup = page.locator(".leaflet-popup-content")
    popup.wait_for(timeout=10_000)
    return popup.inner_text()


@pytest.mark.browser
@pytest.mark.realdata
def test_joplin_map_offline(tmp_path):
    need_chromium()
    from playwright.sync_api import sync_playwright

    root = shared_data("joplin_geotiff")
    vector, html = _score(
        tmp_path,
        "--pre", *sorted((root / "pre").glob("*.tif")),
        "--post", *sorted((root / "post").glob("*.tif")),
        "--buildings", root / "footprints" / "joplin.geojson",
    )  # fmt: skip
    ARTIFACTS.mkdir(exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            view = OfflinePage(browser)
            page = view.page
            ms = view.open(html)
            found = _check_drawn(page, vector)
            tiles = page.evaluate(
                "() => [...document.querySelectorAll('img.leaflet-tile-loaded')]"
                ".filter(i => i.src.startsWith('data:image/webp') && i.naturalWidth === 256).length"
            )
            assert tiles > 0  # the post imagery is on
            page.screenshot(path=str(ARTIFACTS / "map_joplin.png"))
            # a click on a graded building gives its grade, probabilities, confidence, source
            scored = found["scored"]
            row = int(scored.index[len(scored) // 2])
            text = _click_building(page, found["df"], row)
            want = scored.loc[row]
            assert want["damage"] in text and f"#{row} " in text
            assert "source\tgiven" in text
            # three decimals as the popup writes them (JavaScript's rounding of a tie may differ
            # from Python's by one in the last place)
            shown = dict(line.split("\t", 1) for line in text.splitlines() if "\t" in line)
            assert float(shown["confidence"]) == pytest.approx(want["confidence"], abs=6e-4)
            for name in ("no-damage", "minor-damage", "major-damage", "destroyed"):
                got = float(shown[f"p({name})"])
                assert got == pytest.approx(want["p_" + name.replace("-", "_")], abs=6e-4)
            page.wait_for_timeout(400)  # the popup fades in
            page.screenshot(path=str(ARTIFACTS / "map_joplin_click.png"))
            # the pre imagery, switched on in the layer control
            page.get_by_text("Pre imagery").click()
            page.wait_for_function(
                "() => [...document.querySelectorAll('img.leaflet-tile-loaded')]"
                ".some(i => i.closest('.leaflet-layer') && i.complete)",
                timeout=10_000,
            )
            assert page.evaluate("() => localDamage.imagery()") == "pre"
            assert view.blocked == [], f"the map asked for {view.blocked[:3]}"
            # the online basemap: it tries the network (blocked here) and the map keeps working
            page.get_by_text("OpenStreetMap (online)").click()
            page.wait_for_timeout(1500)
            assert view.blocked and all("tile.openstreetmap.org" in u for u in view.blocked)
            assert page.evaluate("() => localDamage.drawn") == found["df"].geometry.notna().sum()
            assert view.errors == [], view.errors
        finally:
            browser.close()
    size = html.stat().st_size
    print(f"\nJoplin map: {size / 1e6:.2f} MB, drawn in {ms:.0f} ms (Chromium, offline)")


@pytest.mark.browser
@pytest.mark.realdata
def test_xbd_tile_map_offline(tmp_path):
    need_chromium()
    from playwright.sync_api import sync_playwright

    root = shared_data("xbd_sample")
    name = "joplin-tornado_00000001"
    vector, html = _score(
        tmp_path,
        "--pre", root / "images" / f"{name}_pre_disaster.png",
        "--post", root / "images" / f"{name}_post_disaster.png",
        "--labels", root / "labels" / f"{name}_post_disaster.json",
    )  # fmt: skip
    labels = json.loads((root / "labels" / f"{name}_post_disaster.json").read_text())
    assert len(labels["features"]["xy"]) > 100
    with sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS
        )
        try:
            view = OfflinePage(browser)
            view.open(html)
            found = _check_drawn(view.page, vector)
            assert found["df"].geometry.notna().sum() == len(labels["features"]["xy"])
            text = _click_building(view.page, found["df"], int(found["scored"].index[0]))
            assert found["scored"].iloc[0]["damage"] in text
            view.page.screenshot(path=str(ARTIFACTS / "map_xbd.png"))
            assert view.blocked == [] and view.errors == [], (view.blocked, view.errors)
        finally:
            browser.close()
