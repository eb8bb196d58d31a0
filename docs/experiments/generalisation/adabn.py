"""Test-time batch-norm re-estimation (AdaBN, Li et al. 2016) of the Michael-free base model on
Michael's chips, against the base model unchanged:

    python docs/experiments/generalisation/adabn.py RUN CHIPS

RUN: the base run of fewshot.md's Michael section; CHIPS: a 64 px store of the five events
(`make all5-chips`: work/all5/events64). Prints accuracy, macro-F1, the share of intact
buildings called damaged and the per-class F1 on all 3,657 Michael buildings.
"""

import sys

import numpy as np
import pandas as pd
import torch
from sklearn.metrics import f1_score

from local_damage.config import load_yaml
from local_damage.data import ChipPairDataset, normalize
from local_damage.models.local_net import build_model
from local_damage.train import checkpoint as ckpt
from local_damage.train.config import Config
from local_damage.train.loop import model_config_for


def main(run: str, chips: str) -> None:
    torch.set_num_threads(2)
    cfg = load_yaml(Config, f"{run}/config.yaml", ["train.device=cpu"])
    manifest = pd.read_csv(f"{chips}/manifest.csv", dtype={"chip_id": str})
    ids = manifest.loc[manifest["event"] == "hurricane-michael", "chip_id"].tolist()
    loader = torch.utils.data.DataLoader(ChipPairDataset(chips, ids, 64), batch_size=128)

    def build():
        net = build_model(model_config_for(cfg))
        ckpt.load_weights(net, f"{run}/best.safetensors")
        return net.eval()

    def grade(net):
        probs, labels = [], []
        with torch.inference_mode():
            for pre, post, y in loader:
                logits, _ = net.predict(normalize(pre), normalize(post))
                probs.append(torch.softmax(logits.float(), 1).numpy())
                labels.append(y.numpy())
        return np.concatenate(probs), np.concatenate(labels)

    def report(name, p, y):
        pred = p.argmax(1)
        print(
            f"{name}: accuracy {(pred == y).mean():.3f}, macro-F1 "
            f"{f1_score(y, pred, average='macro'):.3f}, intact called damaged "
            f"{(pred[y == 0] != 0).mean():.3f}, F1 per class "
            f"{np.round(f1_score(y, pred, average=None), 3).tolist()}"
        )

    report("base", *grade(build()))
    net = build()
    norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    for m in norms:  # a cumulative average over every Michael chip, in training mode
        m.reset_running_stats()
        m.momentum = None
        m.train()
    with torch.inference_mode():
        for pre, post, _ in loader:
            net.encode_pair(normalize(pre), normalize(post))
    report(f"AdaBN ({len(norms)} batch norms re-estimated)", *grade(net.eval()))


if __name__ == "__main__":
    main(*sys.argv[1:3])
