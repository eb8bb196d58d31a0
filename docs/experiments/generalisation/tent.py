"""Test-time entropy minimisation (Tent, Wang et al. 2021) of the Michael-free base model on
Michael's unlabelled chips, against the base model unchanged:

    python docs/experiments/generalisation/tent.py RUN CHIPS [EPOCHS]

RUN: the base run of fewshot.md's Michael section; CHIPS: a 64 px store of the five events
(`make all5-chips`: work/all5/events64). Two variants, each one pass (or EPOCHS passes) over
every Michael chip in shuffled batches of 64, Adam at 1e-3 on the batch norms' scale and shift
only, as the paper does:

- tent: batch norms normalise with each batch's own statistics (the paper's method);
- tent-source-stats: batch norms keep the source statistics, only scale and shift move.

Prints accuracy, macro-F1, the share of intact buildings called damaged and the per-class F1 on
all 3,657 Michael buildings; no label is used by the adaptation.
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


def main(run: str, chips: str, epochs: int = 1) -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    cfg = load_yaml(Config, f"{run}/config.yaml", ["train.device=cpu"])
    manifest = pd.read_csv(f"{chips}/manifest.csv", dtype={"chip_id": str})
    ids = manifest.loc[manifest["event"] == "hurricane-michael", "chip_id"].tolist()
    data = ChipPairDataset(chips, ids, 64)
    loader = torch.utils.data.DataLoader(data, batch_size=128)

    def build():
        net = build_model(model_config_for(cfg))
        ckpt.load_weights(net, f"{run}/best.safetensors")
        return net.eval()

    def grade(net):
        probs, labels = [], []
        net.eval()
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
            f"{np.round(f1_score(y, pred, average=None), 3).tolist()}, mean entropy "
            f"{float(-(p * np.log(p + 1e-12)).sum(1).mean()):.3f}",
            flush=True,
        )

    report("base", *grade(build()))
    for variant in ("tent", "tent-source-stats"):
        net = build()
        norms = [m for m in net.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        for p in net.parameters():
            p.requires_grad_(False)
        params = []
        for m in norms:
            m.weight.requires_grad_(True)
            m.bias.requires_grad_(True)
            params += [m.weight, m.bias]
        opt = torch.optim.Adam(params, lr=1e-3, betas=(0.9, 0.999))
        shuffled = torch.utils.data.DataLoader(data, batch_size=64, shuffle=True)
        for _ in range(epochs):
            for pre, post, _ in shuffled:
                net.eval()
                if variant == "tent":
                    for m in norms:  # normalise with the batch's statistics, as Tent does
                        m.train()
                        m.track_running_stats = False
                        m.running_mean = m.running_var = None
                logits, _ = net.predict(normalize(pre), normalize(post))
                logp = torch.log_softmax(logits.float(), 1)
                loss = -(logp.exp() * logp).sum(1).mean()
                opt.zero_grad()
                loss.backward()
                opt.step()
        if variant == "tent":  # graded as trained: batch statistics of 128 Michael chips
            net.train()
            for m in net.modules():
                if not isinstance(m, torch.nn.BatchNorm2d):
                    m.eval()
            probs, labels = [], []
            with torch.inference_mode():
                for pre, post, y in loader:
                    logits, _ = net.predict(normalize(pre), normalize(post))
                    probs.append(torch.softmax(logits.float(), 1).numpy())
                    labels.append(y.numpy())
            report(
                f"{variant} ({len(norms)} batch norms, {epochs} pass(es))",
                np.concatenate(probs),
                np.concatenate(labels),
            )
        else:
            report(f"{variant} ({len(norms)} batch norms, {epochs} pass(es))", *grade(net))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 1)
