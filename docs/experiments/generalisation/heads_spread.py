"""What holding the adapted heads to the spread of their macro-F1 gain (as `adapt --finetune`
is held, runtime.selection.FINETUNE_RULE) would do on new tiles of known events:

    python docs/experiments/generalisation/heads_spread.py MODEL CHIPS [CHIPS ...] [--k 5,10,20,50]

`bench new-tile`'s heads arm (100 draws per k, seed 0, the same draws each time) under the rule
of `adapt` (no spread), with every head but `base+discount` held to it (`fitted`), and with
every candidate held to it (`all`): the mean macro-F1 gain over the base model, the share of
draws worse by more than 0.01 and the heads kept, per k. Measured with the bundled
`models/default.onnx` on `work/all/chips` (`--k 5,10,20,50,100`) and with the previous default
model (`work/previous-default.onnx`) on `work/default-model/chips` and `work/chips-extra`, both
as in docs/experiments/fewshot.md#a-new-tile-of-a-known-event.
"""

from __future__ import annotations

import argparse

import app.adapt.fit as fit
from studies.newtile import NewTileOptions, bench_new_tile


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("chips", nargs="+")
    ap.add_argument("--k", default="5,10,20,50")
    args = ap.parse_args()
    ks = [int(v) for v in args.k.split(",")]
    options = NewTileOptions(ks=ks, draws=100, arms=("heads",))
    print("spread | k | mean gain | worse by > 0.01 | heads kept")
    for spread in ("", "fitted", "all"):
        fit.HEADS_SPREAD = spread
        result = bench_new_tile(args.model, list(args.chips), options)
        for row in result["summary"]:
            print(
                f"{spread or 'none (adapt)'} | {row['k']} | {row['gain']:+.3f} | "
                f"{row['worse_share']:.0%} | {row['heads']}",
                flush=True,
            )


if __name__ == "__main__":
    main()
