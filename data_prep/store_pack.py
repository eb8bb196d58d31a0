"""A chip store packed small: every chip JPEG-encoded into one file, and unpacked into a store.

A training machine that can receive only a small upload (a lent GPU, say) gets the store as one
``.pack`` file, several times smaller than its shards (a 64 px store of 7,230 buildings: 177 MB of
shards, 38 MB packed at quality 95), and rebuilds an ordinary store from it. JPEG is lossy: a chip
comes back within a few grey levels of the original (a mean absolute difference of about 1.6 at
quality 95), so figures of a model trained on an unpacked store are those of slightly re-encoded
imagery; say so where they are reported.

Layout of a pack: ``b"LDPACK1\\n"``, an 8-byte little-endian header length, a JSON header
(``manifest.csv``, ``store.json`` and ``splits.csv`` as text, and per shard its name, shape and
the byte length of each encoded chip), then the encoded chips in header order.

    python -m data_prep.store_pack pack CHIPS STORE.pack [--quality 95]
    python -m data_prep.store_pack unpack STORE.pack CHIPS
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np

from data_prep.split import SPLITS
from data_prep.store import (
    MANIFEST,
    SHARDS,
    STORE_META,
    StoreError,
    atomic_file,
    start_store,
)

MAGIC = b"LDPACK1\n"
#: Text files of a store carried in the header (when present).
TEXT_FILES = (MANIFEST, STORE_META, SPLITS)


def pack_store(chips: str | Path, out: str | Path, quality: int = 95) -> dict:
    """Write ``out``, the store ``chips`` with every chip JPEG-encoded at ``quality``.

    Returns:
        ``{"chips": n, "bytes": size of the pack, "shard_bytes": size of the shards}``.

    Raises:
        StoreError: ``chips`` has no manifest or no shards.
    """
    import cv2

    root = Path(chips)
    if not (root / MANIFEST).is_file():
        raise StoreError(f"{root}: no {MANIFEST}; is it a chip store?")
    shards = sorted((root / SHARDS).glob("*.npy"))
    if not shards:
        raise StoreError(f"{root / SHARDS}: no shards to pack")
    header: dict = {"files": {}, "shards": []}
    for name in TEXT_FILES:
        if (root / name).is_file():
            with open(root / name, newline="", encoding="utf-8") as f:
                header["files"][name] = f.read()
    blobs: list[bytes] = []
    shard_bytes = 0
    for path in shards:
        array = np.load(path)
        shard_bytes += path.stat().st_size
        lengths = []
        for chip in array:
            ok, buf = cv2.imencode(".jpg", chip, [cv2.IMWRITE_JPEG_QUALITY, int(quality)])
            if not ok:
                raise StoreError(f"{path}: a chip could not be JPEG-encoded")
            blobs.append(buf.tobytes())
            lengths.append(len(blobs[-1]))
        header["shards"].append({"name": path.name, "shape": list(array.shape), "lengths": lengths})
    head = json.dumps(header).encode()
    with atomic_file(out) as f:
        f.write(MAGIC + struct.pack("<Q", len(head)) + head)
        for blob in blobs:
            f.write(blob)
    size = Path(out).stat().st_size
    return {"chips": len(blobs), "bytes": size, "shard_bytes": shard_bytes}


def unpack_store(pack: str | Path, chips: str | Path) -> Path:
    """Rebuild a chip store in ``chips`` from a pack written by :func:`pack_store`.

    Raises:
        StoreError: ``pack`` is not a pack, or is cut short.
    """
    import cv2

    data = Path(pack).read_bytes()
    if not data.startswith(MAGIC):
        raise StoreError(f"{pack}: not a chip store pack (written by `data_prep.store_pack pack`)")
    start = len(MAGIC) + 8
    try:
        (n,) = struct.unpack("<Q", data[len(MAGIC) : start])
        header = json.loads(data[start : start + n])
    except (struct.error, ValueError) as exc:
        raise StoreError(f"{pack}: the pack's header is cut short or damaged ({exc})") from exc
    offset = start + n
    root = start_store(chips)
    for shard in header["shards"]:
        array = np.empty(shard["shape"], dtype=np.uint8)
        for i, length in enumerate(shard["lengths"]):
            if offset + length > len(data):
                raise StoreError(f"{pack}: cut short in {shard['name']}")
            buf = np.frombuffer(data, np.uint8, count=length, offset=offset)
            chip = cv2.imdecode(buf, cv2.IMREAD_UNCHANGED)
            if chip is None or chip.shape != array.shape[1:]:
                raise StoreError(f"{pack}: chip {i} of {shard['name']} does not decode")
            array[i] = chip
            offset += length
        with atomic_file(root / SHARDS / shard["name"], suffix=".npy") as f:
            np.save(f, array)
    # the manifest last: a store is complete only once it is there
    for name in sorted(header["files"], key=lambda k: k == MANIFEST):
        with atomic_file(root / name, text=True) as f:
            f.write(header["files"][name])
    return root


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_prep.store_pack", description=__doc__)
    sub = parser.add_subparsers(dest="verb", required=True)
    p = sub.add_parser("pack", help="pack a chip store into one file")
    p.add_argument("chips")
    p.add_argument("out")
    p.add_argument("--quality", type=int, default=95, help="JPEG quality (default 95)")
    u = sub.add_parser("unpack", help="rebuild a chip store from a pack")
    u.add_argument("pack")
    u.add_argument("chips")
    args = parser.parse_args(argv)
    if args.verb == "pack":
        print(json.dumps(pack_store(args.chips, args.out, args.quality)))
    else:
        print(unpack_store(args.pack, args.chips))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
