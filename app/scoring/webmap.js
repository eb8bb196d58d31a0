/* The local-damage web map: imagery tiles, buildings by grade, legend and building details.
 * Reads its data from the JSON block #ld-data written by app.scoring.webmap; needs Leaflet (L).
 * window.localDamage: {ready, renderMs, drawn, scored, selected, map, layer(row), imagery(),
 * select(row), show(row)}. */
(function () {
  "use strict";
  var data = JSON.parse(document.getElementById("ld-data").textContent);
  var geo = data.georeferenced;
  var BLANK = "data:image/gif;base64,R0lGODlhAQABAIAAAAAAAP///yH5BAEAAAAALAAAAAABAAEAAAIBRAA7";
  var api = { ready: false, renderMs: null, drawn: 0, scored: 0, selected: null };
  window.localDamage = api;

  var b = data.bounds; // west, south, east, north (degrees, or image pixels: 0, height, width, 0)
  var bounds = geo
    ? L.latLngBounds([b[1], b[0]], [b[3], b[2]])
    : L.latLngBounds([-b[1], b[0]], [-b[3], b[2]]);
  var pre = data.layers.pre, post = data.layers.post;
  var nativeMin = Math.min(pre.minZoom, post.minZoom);
  var nativeMax = Math.max(pre.maxZoom, post.maxZoom);
  var minZoom = geo ? Math.max(0, nativeMin - 2) : nativeMin - 2;
  var maxZoom = geo ? Math.min(24, nativeMax + 3) : nativeMax + 3;
  var map = L.map("map", {
    crs: geo ? L.CRS.EPSG3857 : L.CRS.Simple,
    preferCanvas: data.canvas,
    minZoom: minZoom,
    maxZoom: maxZoom,
    zoomSnap: geo ? 1 : 0.5,
  });
  map.fitBounds(bounds);
  api.map = map;

  var Imagery = L.TileLayer.extend({
    initialize: function (layer, options) {
      this._ldTiles = layer.tiles;
      L.TileLayer.prototype.initialize.call(this, "", options);
    },
    getTileUrl: function (c) {
      return this._ldTiles[c.z + "/" + c.x + "/" + c.y] || BLANK;
    },
  });
  function imagery(layer) {
    return new Imagery(layer, {
      minNativeZoom: layer.minZoom,
      maxNativeZoom: layer.maxZoom,
      minZoom: minZoom,
      maxZoom: maxZoom,
      bounds: bounds.pad(0.05),
      noWrap: true,
      keepBuffer: 4,
    });
  }
  var postLayer = imagery(post), preLayer = imagery(pre);
  var base = { "Post imagery": postLayer, "Pre imagery": preLayer, "No imagery": L.layerGroup() };
  var overlays = {};

  if (data.basemap) { // online only: off when the file opens, so opening it sends no request
    map.createPane("basemap").style.zIndex = 150;
    overlays[data.basemap.name] = L.tileLayer(data.basemap.url, {
      pane: "basemap",
      maxNativeZoom: data.basemap.maxNativeZoom,
      maxZoom: maxZoom,
      attribution: data.basemap.attribution,
    });
  }

  function colour(p) {
    return p.damage_id >= 0 ? data.colours[p.damage_id] : data.unscored;
  }
  function style(f) {
    var p = f.properties, c = colour(p), scored = p.damage_id >= 0;
    if (p.corrected) {  // an analyst's grade: its colour, a dashed white outline
      c = data.colours[data.classes.indexOf(p.corrected)] || c;
      return {
        color: "#ffffff", weight: 3, opacity: 1, dashArray: "4 3", fillColor: c,
        fillOpacity: 0.5, className: "ld-building ld-corrected",
      };
    }
    return {
      color: p.flags ? data.flagged : c,
      weight: p.flags ? 3 : 1.5,
      opacity: 1,
      fillColor: c,
      fillOpacity: scored ? 0.35 : 0.05,
      className: "ld-building " + (scored ? "ld-scored" : "ld-unscored") +
        (p.flags ? " ld-flagged" : ""),
    };
  }
  function row(table, name, value) {
    var tr = table.insertRow(), a = tr.insertCell(), v = tr.insertCell();
    a.textContent = name;
    if (value instanceof Node) v.appendChild(value); else v.textContent = value;
  }
  function details(p) {
    var box = document.createElement("div"), head = document.createElement("div");
    box.className = "ld-popup";
    head.className = "ld-grade";
    head.textContent = p.damage_id >= 0 ? p.damage : "not scored";
    head.style.borderLeft = "6px solid " + colour(p);
    head.style.paddingLeft = "5px";
    box.appendChild(head);
    var t = document.createElement("table");
    row(t, "building", "#" + p.n + " (uid " + p.uid + ")");
    if (p.corrected) row(t, "corrected", p.corrected + " (by " + (p.corrected_by || "?") + ")");
    if (p.p) {
      for (var k = 0; k < data.classes.length; k++) {
        var cell = document.createElement("span"), bar = document.createElement("span");
        cell.textContent = p.p[k].toFixed(3);
        bar.className = "ld-bar";
        bar.style.width = Math.round(60 * p.p[k]) + "px";
        cell.appendChild(bar);
        row(t, "p(" + data.classes[k] + ")", cell);
      }
      row(t, "confidence", p.confidence.toFixed(3));
    }
    row(t, "flags", p.flags ? p.flags.split(";").join(", ") : "none");
    row(t, "status", p.status);
    row(t, "source", p.source);
    box.appendChild(t);
    return box;
  }

  var byRow = {};
  var buildings = L.geoJSON(data.buildings, {
    style: style,
    coordsToLatLng: function (c) { return L.latLng(c[1], c[0]); },
    onEachFeature: function (f, layer) {
      byRow[f.properties.n] = layer;
      layer.bindPopup(function () { return details(f.properties); }, { maxWidth: 320 });
      layer.on("click", function () {
        select(f.properties.n, false);
        if (window.parent !== window) {
          window.parent.postMessage(
            { localDamage: "select", row: f.properties.n, uid: f.properties.uid }, "*");
        }
      });
      api.drawn += 1;
      if (f.properties.damage_id >= 0) api.scored += 1;
    },
  });

  var current = null;
  function select(n, open) {
    var layer = byRow[n];
    if (current) buildings.resetStyle(current);
    current = layer || null;
    api.selected = layer ? n : null;
    if (!layer) return false;
    layer.setStyle({ color: "#00e5ff", weight: 4 });
    if (layer.bringToFront) layer.bringToFront();
    if (open) {
      var target = Math.max(map.getZoom(), Math.min(nativeMax, maxZoom));
      map.setView(layer.getBounds().getCenter(), target);
      layer.openPopup(layer.getBounds().getCenter());
    }
    return true;
  }
  api.layer = function (n) { return byRow[n] || null; };
  api.imagery = function () {
    return map.hasLayer(postLayer) ? "post" : map.hasLayer(preLayer) ? "pre" : "none";
  };
  api.select = function (n) { return select(n, false); };
  api.corrected = function (n, grade, by) {  // a correction saved in the page: shown at once
    var layer = byRow[n];
    if (!layer) return false;
    layer.feature.properties.corrected = grade;
    layer.feature.properties.corrected_by = by;
    buildings.resetStyle(layer);
    return true;
  };
  api.show = function (n) { return select(n, true); };
  window.addEventListener("message", function (e) {
    var d = e.data;
    if (d && d.localDamage === "show") api.show(Number(d.row));
    if (d && d.localDamage === "corrected") api.corrected(Number(d.row), d.grade, d.by);
  });

  postLayer.addTo(map);
  buildings.addTo(map);
  overlays.Buildings = buildings;
  L.control.layers(base, overlays, { collapsed: false, position: "topright" }).addTo(map);
  if (geo) L.control.scale({ position: "bottomleft" }).addTo(map); // no metres in image pixels

  var Panel = L.Control.extend({
    onAdd: function () {
      var div = L.DomUtil.create("div", "ld-panel " + this.options.className);
      L.DomEvent.disableClickPropagation(div);
      this.options.fill(div);
      return div;
    },
  });
  new Panel({ position: "topleft", className: "ld-head", fill: function (div) {
    var t = L.DomUtil.create("div", "ld-title", div);
    t.textContent = data.title;
    var s = L.DomUtil.create("div", "ld-note", div);
    var scored = 0;
    for (var k in data.counts) scored += data.counts[k];
    s.textContent = data.nBuildings + " buildings drawn, " + scored + " graded" +
      (data.note ? "; " + data.note : "");
  } }).addTo(map);
  new Panel({ position: "bottomright", className: "ld-legend", fill: function (div) {
    function entry(name, count, fill, line) {
      var r = L.DomUtil.create("div", "", div), sw = L.DomUtil.create("span", "ld-swatch", r);
      sw.style.background = fill;
      if (line) { sw.style.border = "3px solid " + line; }
      L.DomUtil.create("span", "", r).textContent = name;
      L.DomUtil.create("span", "ld-count", r).textContent = count;
    }
    data.classes.forEach(function (name, k) { entry(name, data.counts[name] || 0, data.colours[k]); });
    var scored = 0;
    for (var k in data.counts) scored += data.counts[k];
    entry("not scored", data.nBuildings - scored, "transparent", data.unscored);
    entry(data.flaggedLabel, data.nFlagged, "transparent", data.flagged);
  } }).addTo(map);

  function done() {
    if (api.ready) return;
    api.ready = true;
    api.renderMs = performance.now();
    document.documentElement.setAttribute("data-ready", "1");
  }
  postLayer.on("load", done);
  setTimeout(function () { if (!postLayer.isLoading()) done(); }, 0);
})();
