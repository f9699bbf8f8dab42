"""Named regimes declare what they are (conf/regime/*.yaml: regime_meta) and the regime map pairs runs by that
declaration, so renaming a regime file changes no comparison."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from humanline_cli.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
REGIMES = ROOT / "conf" / "regime"


def _metas() -> dict[str, dict]:
    return {f.stem: yaml.safe_load(f.read_text())["regime_meta"] for f in sorted(REGIMES.glob("*.yaml"))}


def test_every_regime_declares_itself_and_its_comparisons_exist():
    metas = _metas()
    names = {m["name"] for m in metas.values()}
    assert len(names) == len(metas)  # a name is unique in the study
    for stem, m in metas.items():
        doc = yaml.safe_load((REGIMES / f"{stem}.yaml").read_text())
        humanline = doc.get("humanline") is True
        assert (m["family"] == "humanline") == humanline, stem
        if humanline:  # both ends of its gap are declared regimes of the right families
            fam = {x["name"]: x["family"] for x in metas.values()}
            assert fam[m["target"]] == "online", stem
            if m.get("baseline") is None:  # humanline on online rounds: no other data to be the baseline of
                assert {"override /data": "online"} in doc.get("defaults", []), stem
                assert (doc.get("data") or {}).get("generate_every") is None, stem
            else:
                assert fam[m["baseline"]] in ("offline", "stale"), stem
        else:
            assert m.get("baseline") is None and m.get("target") is None, stem


def test_family_must_agree_with_humanline():
    from humanline_cli.config import resolve

    with (initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"),
          pytest.raises(UserError, match="regime_meta.family=humanline but humanline=False")):
        resolve(compose("train", overrides=["regime=hl", "humanline=false"]))


# regime -> accuracy per seed: humanline closes (0.75 - 0.6) / (0.9 - 0.6) = 50% of the padded gap
PLAN = {"offline": [0.70, 0.70], "online": [0.90, 0.90], "hl": [0.80, 0.80], "offline_padded": [0.60, 0.60],
        "hl_padded": [0.75, 0.75]}


def _sweep(conf: Path, root: Path, files: dict[str, str]) -> Path:
    """A regime sweep composed from `conf` (regime file -> the file it is read from) and saved as Hydra saves
    each job: .hydra/config.yaml, .hydra/overrides.yaml, summary.json; multirun.yaml lists the files swept."""
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"):
        for regime, accs in PLAN.items():
            cfg = compose("train", overrides=[f"regime={files[regime]}", "objective=grpo"])
            online = cfg.data.regime == "online"
            for seed, acc in enumerate(accs):
                d = root / f"{files[regime]}_{seed}"
                (d / ".hydra").mkdir(parents=True)
                cfg.seed = seed
                (d / ".hydra" / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
                (d / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump([f"regime={files[regime]}", "objective=grpo"]))
                (d / "summary.json").write_text(json.dumps({
                    "status": "complete", "objective": "grpo", "data": cfg.data.regime, "task": "arithmetic",
                    "humanline": bool(cfg.humanline), "seed": seed, "eval": {"accuracy": acc},
                    "wall_clock_s": {"total": 100.0 if online else 25.0, "train": 24.0}}))
    (root / "multirun.yaml").write_text(yaml.safe_dump(
        {"hydra": {"sweeper": {"params": {"regime": ",".join(files[r] for r in PLAN)}}}}))
    return root


def _pairs(root: Path) -> list[tuple]:
    from humanline_cli.lab.regime_map import sweep_rows

    return [(r["regime"], r["compared_with"], r["metric"], round(float(r["gap_closed"]), 12))
            for r in sweep_rows(root).to_dict("records") if r["metric"] == "accuracy"]


def test_renaming_a_regime_file_changes_no_comparison(tmp_path):
    renamed = tmp_path / "conf"
    shutil.copytree(ROOT / "conf", renamed)
    files = {r: r for r in PLAN}
    # the humanline regime and its baseline under names that share no prefix with anything
    for regime, new in (("hl_padded", "clamped_replies"), ("offline_padded", "plain_replies")):
        (renamed / "regime" / f"{regime}.yaml").rename(renamed / "regime" / f"{new}.yaml")
        files[regime] = new
    original = _pairs(_sweep(ROOT / "conf", tmp_path / "original", {r: r for r in PLAN}))
    after = _pairs(_sweep(renamed, tmp_path / "renamed", files))
    # hl: (0.8 - 0.7) / (0.9 - 0.7) = 50%; hl_padded against offline_padded: (0.75 - 0.6) / (0.9 - 0.6) = 50%
    assert original == [("hl", "offline, online", "accuracy", 0.5),
                        ("hl_padded", "offline_padded, online", "accuracy", 0.5)]
    assert after == original
