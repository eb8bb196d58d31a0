"""Where the time of `adapt --finetune` goes on Michael's labels, per number of labels:

    python docs/experiments/generalisation/finetune_time.py WEIGHTS MODEL CHIPS [K ...]

WEIGHTS/MODEL: the Michael-free base of fewshot.md (work/fs8/hurricane-michael/base.safetensors
and base.onnx); CHIPS: work/all5/chips64; K: numbers of labels (default 20 50 100 200 500).
For each K, draws K of Michael's labelled buildings (seed K) and times the whole fine-tuning as
`adapt --finetune` runs it (default options: one torch thread per core): the frozen trunk's
features over the 8 turns, the 3-fold cross-validation over 8 epochs and, when kept, the final
training. For the largest K, also the frozen trunk alone.
"""

import sys
import time

import numpy as np
import torch

from app.adapt.labelled import from_chip_store
from local_damage.adapt import finetune as ft
from local_damage.adapt.network import load_network, prepare_chips, split_network, trunk_features
from runtime.predictor import Predictor


def main(weights: str, model: str, chips: str, ks: list[int]) -> None:
    names = list(Predictor(model).class_names)
    b = from_chip_store(chips, names, event="hurricane-michael")
    b = b.subset(b.labelled)
    print(f"torch threads: {torch.get_num_threads()}")
    for k in ks:
        idx = np.random.default_rng(k).permutation(len(b))[:k]
        t = time.perf_counter()
        r = ft.finetune(weights, b.pre[idx], b.post[idx], b.labels[idx], ft.FinetuneOptions())
        print(f"k = {k}: fine-tuning {time.perf_counter() - t:.1f} s ({r.epochs} epoch(s) kept)")
    idx = np.random.default_rng(max(ks)).permutation(len(b))[: max(ks)]
    net, config = load_network(weights)
    trunk, _, _ = split_network(net, 1)
    size = ft.input_size(config, b.pre.shape[1])
    t = time.perf_counter()
    trunk_features(trunk, prepare_chips(b.pre[idx], size), prepare_chips(b.post[idx], size))
    print(f"frozen trunk alone, 8 turns x {max(ks)} pairs: {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main(*sys.argv[1:4], [int(v) for v in sys.argv[4:]] or [20, 50, 100, 200, 500])
