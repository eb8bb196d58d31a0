"""`local-damage labels` (the label store of a labelling campaign) and `local-damage users` (its
analysts).

- ``labels show STORE``: corrections per event, grade and analyst; ``--history SCENE UID`` one
  building's corrections.
- ``labels export STORE --out DIR``: the latest correction of each building as GeoJSON or
  GeoPackage for GIS, and the corrected xBD tiles as xBD labels for ``prepare xbd``.
- ``labels import WORK``: the ``corrections.json`` of a work folder's assessments, into its store.
- ``users add FILE NAME``: add an analyst (or a new password) to a users file; ``users list FILE``.
"""

from __future__ import annotations

import argparse
import getpass
import json
import os
import sys
from pathlib import Path

from app.web.campaign import export_store, summary
from app.web.sessions import AppError, import_work
from app.web.users import add_user, read_users
from cli.options import add_json_switch
from data_prep.label_store import STORE_NAME, LabelStore


def _store(path: str) -> Path:
    """A store file, or a work folder holding one."""
    p = Path(path)
    return p / STORE_NAME if p.is_dir() else p


def _run_show(args: argparse.Namespace) -> int:
    store = _store(args.store)
    if args.history:
        scene, uid = args.history
        rows = LabelStore(store).history(scene, uid)
        if not rows:
            raise AppError(f"{store}: no correction of building {uid} of {scene}")
        for c in rows:
            print(f"{c.time}  {c.analyst:<16} {c.grade:<14} (model: {c.predicted}; {c.source})")
        return 0
    print(summary(store))
    return 0


def _run_export(args: argparse.Namespace) -> int:
    done = export_store(_store(args.store), args.out, args.event, args.name, not args.no_xbd)
    print(f"wrote {done.vector}: {done.buildings} corrected buildings", file=sys.stderr)
    if done.xbd:
        print(
            f"wrote {done.xbd_tiles} xBD tile(s) under {done.xbd}; cut their chips with: "
            f"local-damage prepare xbd --xbd {done.xbd} --out CHIPS",
            file=sys.stderr,
        )
    for line in done.left_out:
        print(f"warning: left out: {line}", file=sys.stderr)
    if args.json:
        print(json.dumps({"vector": str(done.vector), "xbd": str(done.xbd or ""),
                          "buildings": done.buildings, "xbd_tiles": done.xbd_tiles,
                          "left_out": done.left_out}, indent=2))  # fmt: skip
    return 0


def _run_import(args: argparse.Namespace) -> int:
    rows, problems = import_work(args.work)
    print(f"imported {rows} correction(s) into {Path(args.work) / STORE_NAME}", file=sys.stderr)
    for line in problems:
        print(f"warning: not imported: {line}", file=sys.stderr)
    return 1 if problems else 0


def _password(env: str | None) -> str:
    if env:
        value = os.environ.get(env, "")
        if not value:
            raise AppError(f"the environment variable {env} holds no password")
        return value
    first = getpass.getpass("password: ")
    if first != getpass.getpass("again: "):
        raise AppError("the two passwords differ; nothing written")
    return first


def _run_users_add(args: argparse.Namespace) -> int:
    new = add_user(args.file, args.name, _password(args.password_env))
    what = "added" if new else "new password for"
    print(f"{what} {args.name} in {args.file}", file=sys.stderr)
    return 0


def _run_users_list(args: argparse.Namespace) -> int:
    for name in read_users(args.file):
        print(name)
    return 0


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add `labels` and `users` to the top-level subcommands."""
    labels = sub.add_parser(
        "labels",
        help="the analysts' label store (WORK/labels.gpkg): summary, history, export, import",
        description="The label store of a labelling campaign: every correction saved in the app "
        "is a row of WORK/labels.gpkg (a GeoPackage QGIS and GeoPandas open; the latest row of "
        "a building wins). See docs/app.md.",
    )
    lsub = labels.add_subparsers(dest="labels", metavar="WHAT", required=True)
    show = lsub.add_parser("show", help="corrections per event, grade and analyst")
    show.add_argument("store", metavar="STORE", help="labels.gpkg, or the app's work folder")
    show.add_argument(
        "--history", nargs=2, metavar=("SCENE", "UID"), help="every correction of one building"
    )
    show.set_defaults(func=_run_show)
    export = lsub.add_parser(
        "export",
        help="latest corrections as GeoJSON/GeoPackage, and xBD labels for `prepare xbd`",
    )
    export.add_argument("store", metavar="STORE", help="labels.gpkg, or the app's work folder")
    export.add_argument("--out", required=True, metavar="DIR", help="output folder")
    export.add_argument("--event", help="only this event's corrections")
    export.add_argument(
        "--name",
        default="corrections.geojson",
        help="vector file name in DIR; .gpkg for a GeoPackage (default corrections.geojson)",
    )
    export.add_argument("--no-xbd", action="store_true", help="no xBD label folder")
    add_json_switch(export, help="print what was written as JSON")
    export.set_defaults(func=_run_export)
    imp = lsub.add_parser(
        "import", help="import the corrections.json of a work folder's assessments (once)"
    )
    imp.add_argument("work", metavar="WORK", help="the app's work folder (WORK/sessions)")
    imp.set_defaults(func=_run_import)

    users = sub.add_parser(
        "users",
        help="the analysts of `app --users FILE`: add one, list them",
        description="A users file lists the analysts who may log in to the app (name and a "
        "salted scrypt hash of the password per line; no password is stored).",
    )
    usub = users.add_subparsers(dest="users", metavar="WHAT", required=True)
    add = usub.add_parser("add", help="add an analyst, or set a new password")
    add.add_argument("file", metavar="FILE", help="users file (created if missing)")
    add.add_argument("name", metavar="NAME", help="the analyst's login name")
    add.add_argument(
        "--password-env",
        metavar="VAR",
        help="environment variable holding the password (default: asked twice, not echoed)",
    )
    add.set_defaults(func=_run_users_add)
    ls = usub.add_parser("list", help="the analysts of a users file")
    ls.add_argument("file", metavar="FILE", help="users file")
    ls.set_defaults(func=_run_users_list)
