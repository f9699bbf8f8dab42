"""IPO's loss against hand-computed values, and a run of `humanline train objective=ipo`."""
from __future__ import annotations

import json
import math

import pytest
import torch

from humanline_cli.core.objectives.ipo import ipo_loss
from tests.helpers.cli import FAST, TINY_WORLD, run_cli

D = torch.float64

# chosen: pair0 r_w = 0.5 + 0.25 = 0.75 (100 padded); pair1 r_w = 2.0 + 1.0 = 3.0
# rejected: pair0 r_l = -0.25 (-999 padded); pair1 r_l = 0.25 + 0.25 = 0.5
# h = 1.0 and 2.5; beta = 0.25: the target 1 / (2 beta) = 2
CHOSEN = [[0.5, 0.25, 100.0], [2.0, 1.0, 0.0]]
M_CHOSEN = [[1, 1, 0], [1, 1, 1]]
REJECTED = [[-0.25, -999.0, -999.0], [0.25, 0.25, 0.0]]
M_REJECTED = [[1, 0, 0], [1, 1, 0]]


def test_ipo_hand_computed_loss_and_gradient():
    chosen = torch.tensor(CHOSEN, dtype=D, requires_grad=True)
    rejected = torch.tensor(REJECTED, dtype=D, requires_grad=True)
    loss, m = ipo_loss(chosen, torch.tensor(M_CHOSEN, dtype=D), rejected, torch.tensor(M_REJECTED, dtype=D), 0.25)
    assert loss.item() == pytest.approx(((1.0 - 2.0) ** 2 + (2.5 - 2.0) ** 2) / 2, rel=1e-12)  # 0.625
    assert m["ipo/h"] == pytest.approx(1.75) and m["ipo/accuracy"] == 1.0
    loss.backward()
    # d loss / d h_i = 2 (h_i - 2) / 2: -1 and 0.5, on every unmasked chosen token, negated on the rejected ones
    assert chosen.grad.tolist() == [[-1.0, -1.0, 0.0], [0.5, 0.5, 0.5]]
    assert rejected.grad.tolist() == [[1.0, 0.0, 0.0], [-0.5, -0.5, 0.0]]


def test_ipo_at_the_reference_is_a_quarter_over_beta_squared():
    z = torch.zeros(3, 4, dtype=D)
    loss, _ = ipo_loss(z, torch.ones_like(z), z, torch.ones_like(z), 0.1)
    assert loss.item() == pytest.approx(1 / (4 * 0.01), rel=1e-12)


def test_humanline_train_objective_ipo(tmp_path, cache_dir):
    run = tmp_path / "run"
    r = run_cli(["train", *TINY_WORLD, *FAST, "train.steps=2", "eval.n_prompts=4", "backend=cpu", "objective=ipo",
                 "objective.beta=0.5", "+humanline=true", f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(row["loss"]) and "ipo/h" in row for row in rows)
    assert abs(rows[0]["loss"] - 1.0) < 1e-4  # the first step's policy is the reference: h = 0, (0 - 1)^2
