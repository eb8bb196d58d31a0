"""Where the time of `adapt --finetune` goes on 500 labels of Michael (one thread, as it runs):

    python docs/experiments/generalisation/finetune_time.py WEIGHTS MODEL CHIPS

WEIGHTS/MODEL: the Michael-free base of fewshot.md (work/fs8/hurricane-michael/base.safetensors
and base.onnx); CHIPS: work/all5/chips64. Draws 500 of Michael's labelled buildings (seed 0),
times the frozen trunk's features over the 8 turns alone, then the whole fine-tuning (the same
features again, the 3-fold cross-validation over 8 epochs, the final training when kept).
"""

import sys
import time

import numpy as np
import torch

from app.adapt.labelled import from_chip_store
from local_damage.adapt import finetune as ft
from local_damage.adapt.network import load_network, prepare_chips, split_network, trunk_features
from runtime.predictor import Predictor


def main(weights: str, model: str, chips: str) -> None:
    names = list(Predictor(model).class_names)
    b = from_chip_store(chips, names, event="hurricane-michael")
    b = b.subset(b.labelled)
    idx = np.random.default_rng(0).permutation(len(b))[:500]
    pre, post, y = b.pre[idx], b.post[idx], b.labels[idx]
    torch.set_num_threads(1)
    net, config = load_network(weights)
    trunk, _, _ = split_network(net, 1)
    size = ft.input_size(config, pre.shape[1])
    t = time.perf_counter()
    trunk_features(trunk, prepare_chips(pre, size), prepare_chips(post, size))
    print(f"frozen trunk, 8 turns x 500 pairs: {time.perf_counter() - t:.1f} s")
    t = time.perf_counter()
    r = ft.finetune(weights, pre, post, y, ft.FinetuneOptions())
    print(f"fine-tuning, all of it: {time.perf_counter() - t:.1f} s ({r.epochs} epoch(s) kept)")


if __name__ == "__main__":
    main(*sys.argv[1:4])
