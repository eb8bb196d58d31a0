"""Every shipped config loads, names its method, and the documented experiment commands parse."""

from __future__ import annotations

import re
import shlex

import pytest

from cli.main import build_parser
from local_damage.config import load_yaml
from local_damage.losses.objective import uses_latent
from local_damage.train.config import Config
from tests.conftest import REPO

CONFIGS = sorted((REPO / "configs").glob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_config_loads(path):
    if path.stem == "localize":  # the building localiser's config (docs/localize.md)
        from local_damage.localize.config import LocalizeConfig

        cfg = load_yaml(LocalizeConfig, path)
        assert cfg.data.scale > 0 and cfg.calibration.thresholds
        return
    cfg = load_yaml(Config, path)
    if path.stem in ("local", "l-scl", "scl", "ce"):
        assert cfg.loss.method == path.stem
        # the latent module is there exactly for the methods that use it (Appendix A.2)
        assert bool(cfg.model.latent_blocks) == uses_latent(cfg.loss.method)


def test_experiment_commands_parse_and_overrides_apply():
    text = (REPO / "docs" / "experiments" / "paper-tables.md").read_text()
    commands = re.findall(r"^(local-damage (?:cv|train) .+)$", text, flags=re.M)
    assert len(commands) >= 28  # Table 2: 11 rows, 3: 2, 4: 6, 5: 8, plus one train
    parser = build_parser()
    for line in commands:
        args = parser.parse_args(shlex.split(line)[1:])
        configs = args.config if isinstance(args.config, list) else [args.config]
        for config in configs:
            load_yaml(Config, REPO / config, args.set)


def test_cpu_configs_differ_only_where_their_method_does():
    """cpu-local against cpu-l-scl: only the loss changed; cpu-scl also drops the latent module.
    cpu-local is LOCAL as the paper defines it (signed latent map, unit z)."""
    from dataclasses import asdict

    from local_damage.train.config import fidelity_notes

    def flat(stem: str) -> dict:
        cfg = load_yaml(Config, REPO / "configs" / f"{stem}.yaml")
        out = {f"{k}.{kk}": vv for k, v in asdict(cfg).items() for kk, vv in v.items()}
        return out

    local, l_scl, scl = flat("cpu-local"), flat("cpu-l-scl"), flat("cpu-scl")
    assert local["loss.method"] == "local" and not local["model.latent_abs"]
    assert (
        local["loss.normalize_z"]
        and fidelity_notes(load_yaml(Config, REPO / "configs" / "cpu-local.yaml")) == []
    )
    assert {k for k in local if local[k] != l_scl[k]} == {"loss.method"}
    assert {k for k in local if local[k] != scl[k]} == {"loss.method", "model.latent_blocks"}
    # the CPU scale of the bundled model's recipe
    default = flat("default")
    for key in (
        "model.encoder",
        "data.input_size",
        "train.batch_size",
        "train.epochs",
        "loss.temperature",
    ):
        assert local[key] == default[key], key


def test_pretrained_configs_differ_from_cpu_local_only_in_the_weights():
    """cpu-local-pre-<loss>: cpu-local from the encoder `pretrain --loss <loss>` writes, and the
    pretrain command in their header parses and writes where the config reads."""
    from dataclasses import asdict

    base = asdict(load_yaml(Config, REPO / "configs" / "cpu-local.yaml"))
    parser = build_parser()
    for loss in ("balanced", "ntxent"):
        path = REPO / "configs" / f"cpu-local-pre-{loss}.yaml"
        cfg = asdict(load_yaml(Config, path))
        changed = {(k, kk) for k, v in base.items() for kk in v if v[kk] != cfg[k][kk]}
        assert changed == {("model", "weights")}
        head = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
        start = next(i for i, line in enumerate(head) if line.startswith("local-damage pretrain"))
        command = " ".join(line.rstrip("\\").strip() for line in head[start : start + 3])
        args = parser.parse_args(shlex.split(command)[1:])
        assert args.loss == loss
        assert cfg["model"]["weights"] == f"{args.out}/encoder.safetensors"


def test_pretrained_general_candidate_differs_from_the_general_recipe_only_in_its_start():
    """cpu-local-general-pre: the general recipe from the SimCLR-strength encoder of all five
    events' pixels, the encoder frozen for an epoch then at a tenth of the rate; its header's
    pretrain command parses, takes Michael's tiles and writes where the config reads."""
    from dataclasses import asdict

    base = asdict(load_yaml(Config, REPO / "configs" / "cpu-local-general.yaml"))
    path = REPO / "configs" / "cpu-local-general-pre.yaml"
    cfg = asdict(load_yaml(Config, path))
    changed = {(k, kk) for k, v in base.items() for kk in v if v[kk] != cfg[k][kk]}
    assert changed == {
        ("model", "weights"),
        ("optim", "encoder_lr_scale"),
        ("train", "freeze_encoder_epochs"),
    }
    assert cfg["optim"]["encoder_lr_scale"] == 0.1 and cfg["train"]["freeze_encoder_epochs"] == 1
    head = [line[1:].strip() for line in path.read_text().splitlines() if line.startswith("#")]
    start = next(i for i, line in enumerate(head) if line.startswith("local-damage pretrain"))
    command = " ".join(line.rstrip("\\").strip() for line in head[start : start + 3])
    args = build_parser().parse_args(shlex.split(command)[1:])
    assert args.augment == "simclr" and any("michael" in x for x in args.xbd)
    assert cfg["model"]["weights"] == f"{args.out}/encoder.safetensors"


def test_bare_off_is_the_word_for_a_text_field(tmp_path):
    """YAML reads a bare `off` as false: `--set train.amp=off` and `amp: off` in a file mean the
    setting "off", not an error about 'False'."""
    assert load_yaml(Config, None, ["train.amp=off"]).train.amp == "off"
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  amp: off\n")
    assert load_yaml(Config, path).train.amp == "off"
    assert load_yaml(Config, None, ["train.amp=bf16"]).train.amp == "bf16"
