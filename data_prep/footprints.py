"""Building footprints from GeoJSON, GeoPackage or Shapefile, reprojected to a raster CRS.

Read with pyogrio (GDAL/OGR) into shapely geometries; no GeoPandas needed at run time.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from data_prep.errors import not_found
from data_prep.grid import reproject_geometries
from data_prep.mosaic import SceneError
from data_prep.report import Skipped
from data_prep.spec import UNLABELLED, parse_label

#: Attribute used as the building id when present (and unique); otherwise the feature id.
UID_FIELD = "uid"


@dataclass
class Footprints:
    """Polygons of the usable buildings of one footprint file, in a target CRS.

    Arrays are aligned: entry ``i`` of ``geometries``, ``uids``, ``labels`` and ``rows`` describes
    the same building.

    Attributes:
        path: the footprint file.
        crs: the CRS the geometries are in (the raster's).
        source_crs: the file's own CRS as reported by GDAL.
        geometries: [N] shapely (Multi)Polygons in ``crs``.
        uids: [N] building ids (``uid`` attribute when present and unique, else the feature id).
        labels: [N] int class ids 0-3, -1 when unlabelled (no label field or an empty value).
        rows: [N] position of each building among the file's features.
        total: number of features in the file.
        label_field: the attribute the labels came from, None when unlabelled.
        skipped: features left out (no geometry, not a polygon, bad label), with the reason.
    """

    path: str
    crs: object
    source_crs: str
    geometries: np.ndarray
    uids: list[str]
    labels: np.ndarray
    rows: np.ndarray
    total: int
    label_field: str | None = None
    skipped: list[Skipped] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.geometries)

    def lonlat(self) -> np.ndarray:
        """[N, 2] centroid (longitude, latitude) in degrees, EPSG:4326."""
        import shapely

        if not len(self):
            return np.zeros((0, 2))
        centroids = shapely.centroid(self.geometries)
        ll = reproject_geometries(centroids, self.crs, "EPSG:4326")
        return np.column_stack([shapely.get_x(ll), shapely.get_y(ll)])


def read_footprint_file(path: str | os.PathLike, layer: str | int | None = None) -> tuple:
    """Every feature of a footprint file as OGR reads it (``pyogrio.raw.read`` with 2-D
    geometries and feature ids): ``(meta, fids, wkb, values)``.

    Raises:
        SceneError: naming the file, when it is missing or unreadable.
    """
    from pyogrio.errors import DataLayerError, DataSourceError
    from pyogrio.raw import read

    path = str(path)
    if not os.path.exists(path):
        raise SceneError(path, not_found(path, "footprint file not found"))
    try:
        return read(path, layer=layer, force_2d=True, return_fids=True)
    except (DataSourceError, DataLayerError, RuntimeError, ValueError) as exc:
        raise SceneError(
            path, f"cannot be read as building footprints (GeoJSON, GeoPackage or Shapefile): {exc}"
        ) from exc


def load_footprints(
    path: str | os.PathLike,
    crs,
    label_field: str | None = None,
    layer: str | int | None = None,
    raw: tuple | None = None,
) -> Footprints:
    """Read building polygons and reproject them to ``crs``.

    Args:
        path: a GeoJSON, GeoPackage or Shapefile (anything OGR reads) in any CRS.
        crs: target CRS (rasterio/pyproj CRS or a string such as ``"EPSG:32615"``).
        label_field: attribute holding the damage label (class name or 0-3); a value that is not a
            class leaves that building out with a message; an empty value makes it unlabelled.
        layer: layer name or index for multi-layer files (default: the first layer).
        raw: the file as :func:`read_footprint_file` read it, when the caller has read it
            already (None: read here).

    Returns:
        The usable buildings (see :class:`Footprints`).

    Raises:
        SceneError: naming the file, when it is missing, unreadable, empty, has no CRS, has no
            polygons, or lacks ``label_field``.
    """
    import shapely

    path = str(path)
    meta, fids, wkb, values = read_footprint_file(path, layer) if raw is None else raw
    fields = [str(f) for f in meta["fields"]]
    if wkb is None or len(wkb) == 0:
        raise SceneError(
            path, "holds no features; a footprint file with building polygons is required"
        )
    if not meta.get("crs"):
        raise SceneError(
            path, "has no CRS; add one (e.g. the .prj of a Shapefile) so footprints can be placed"
        )
    if label_field is not None and label_field not in fields:
        raise SceneError(
            path,
            f"has no attribute {label_field!r} for --label-field; its attributes are: "
            + (", ".join(fields) or "(none)"),
        )
    total = len(wkb)
    geoms = np.array([None if g is None else shapely.from_wkb(g) for g in wkb], dtype=object)
    fids = np.arange(total) if fids is None else np.asarray(fids)
    column = dict(zip(fields, values, strict=True))
    if UID_FIELD in column and _unique_nonempty(column[UID_FIELD]):
        uids = [str(v) for v in column[UID_FIELD]]
    else:
        uids = [str(int(f)) for f in fids]
    labels_in = column[label_field] if label_field is not None else None

    skipped: list[Skipped] = []
    keep: list[int] = []
    labels: list[int] = []
    polygons: list = []
    for i, geom in enumerate(geoms):
        item = f"{path} feature {uids[i]}"
        if geom is None or geom.is_empty:
            skipped.append(Skipped(item, "has no geometry"))
            continue
        if not geom.is_valid:
            geom = _polygonal(shapely.make_valid(geom))
        if geom is None or geom.geom_type not in ("Polygon", "MultiPolygon"):
            skipped.append(
                Skipped(
                    item,
                    f"is a {geom.geom_type if geom is not None else 'degenerate shape'}, not a building polygon",
                )
            )
            continue
        label = UNLABELLED
        if labels_in is not None:
            try:
                parsed = parse_label(labels_in[i])
            except ValueError as exc:
                skipped.append(Skipped(item, f"field {label_field!r}: {exc}"))
                continue
            label = UNLABELLED if parsed is None else parsed
        keep.append(i)
        labels.append(label)
        polygons.append(geom)
    if not keep:
        raise SceneError(path, f"none of its {total} feature(s) is a usable building polygon")
    keep, labels, polygons = _in_lonlat_range(
        path, meta["crs"], keep, labels, polygons, uids, skipped
    )

    projected = reproject_geometries(np.array(polygons, dtype=object), meta["crs"], crs)
    bounds = shapely.bounds(projected)
    finite = np.isfinite(bounds).all(axis=1)
    geometries, kept_rows, kept_labels = [], [], []
    for j, ok in enumerate(finite):
        if not ok:
            skipped.append(
                Skipped(
                    f"{path} feature {uids[keep[j]]}",
                    f"cannot be transformed from {meta['crs']} to the raster CRS",
                )
            )
            continue
        geometries.append(projected[j])
        kept_rows.append(keep[j])
        kept_labels.append(labels[j])
    return Footprints(
        path=path,
        crs=crs,
        source_crs=_crs_name(meta["crs"]),
        geometries=np.array(geometries, dtype=object),
        uids=[uids[i] for i in kept_rows],
        labels=np.array(kept_labels, dtype=np.int64),
        rows=np.array(kept_rows, dtype=np.int64),
        total=total,
        label_field=label_field,
        skipped=skipped,
    )


def _in_lonlat_range(path, source_crs, keep, labels, polygons, uids, skipped):
    """Keep the polygons whose coordinates can be longitude/latitude when the file's CRS is
    geographic; the others are skipped with the reason.

    Raises:
        SceneError: none can be: coordinates in metres read as degrees (a GeoJSON without a
            ``crs`` member is CRS84), naming the file, its bounds and what to do.
    """
    import shapely
    from pyproj import CRS
    from pyproj.exceptions import CRSError

    try:
        geographic = CRS.from_user_input(source_crs).is_geographic
    except CRSError:
        return keep, labels, polygons
    if not geographic:
        return keep, labels, polygons
    bounds = shapely.bounds(np.array(polygons, dtype=object))
    ok = (
        (bounds[:, 0] >= -180)
        & (bounds[:, 2] <= 180)
        & (bounds[:, 1] >= -90)
        & (bounds[:, 3] <= 90)
    )
    if ok.all():
        return keep, labels, polygons
    if not ok.any():
        x0, y0 = bounds[:, 0].min(), bounds[:, 1].min()
        x1, y1 = bounds[:, 2].max(), bounds[:, 3].max()
        geojson = str(path).lower().endswith((".geojson", ".json"))
        raise SceneError(
            path,
            f"its coordinates span x {x0:.1f} to {x1:.1f}, y {y0:.1f} to {y1:.1f}, outside "
            f"longitude/latitude, but its CRS is {_crs_name(source_crs)}"
            + (" (a GeoJSON without a crs member is read as longitude/latitude, CRS84)"
               if geojson else "")
            + "; they look like projected coordinates (metres). Declare their CRS (in GeoJSON a "
            'crs member: "crs": {"type": "name", "properties": {"name": '
            '"urn:ogc:def:crs:EPSG::<code>"}}), convert the file to EPSG:4326 (ogr2ogr -s_srs '
            "EPSG:<code> -t_srs EPSG:4326 out.geojson in.geojson), or use a GeoPackage, which "
            "records its CRS",
        )  # fmt: skip
    for j in np.flatnonzero(~ok):
        skipped.append(
            Skipped(
                f"{path} feature {uids[keep[j]]}",
                "coordinates outside longitude/latitude, the range of the file's CRS",
            )
        )
    return (
        [k for k, good in zip(keep, ok, strict=True) if good],
        [v for v, good in zip(labels, ok, strict=True) if good],
        [g for g, good in zip(polygons, ok, strict=True) if good],
    )


def _crs_name(crs: str) -> str:
    """A short name for a CRS (``EPSG:4326``, ``OGC:CRS84``), or its text when it has none."""
    from pyproj import CRS
    from pyproj.exceptions import CRSError

    try:
        return CRS.from_user_input(crs).to_string()
    except CRSError:
        return str(crs)


def _unique_nonempty(values) -> bool:
    texts = ["" if v is None else str(v) for v in values]
    return all(texts) and len(set(texts)) == len(texts)


def _polygonal(geom):
    """The polygonal part of a repaired geometry (None when nothing polygonal is left)."""
    import shapely

    if geom.geom_type in ("Polygon", "MultiPolygon"):
        return geom
    if geom.geom_type == "GeometryCollection":
        parts = [g for g in shapely.get_parts(geom) if g.geom_type in ("Polygon", "MultiPolygon")]
        if parts:
            return shapely.union_all(parts)
        return None
    return geom
