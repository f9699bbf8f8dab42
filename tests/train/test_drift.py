"""Drift from the sampler, logged per step (metrics.jsonl): the mean policy - sampler log-prob on the trained
tokens and the k3 KL estimate, 0 for online before its first update and growing with the staleness K."""
from __future__ import annotations

import json
import math

import pytest
import torch

from humanline_cli.core.objectives import sampler_drift
from tests.helpers.cli import FAST, TINY_WORLD, run_cli


def test_sampler_drift_hand_computed():
    pol = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, 0.0, 0.0]], dtype=torch.float64)
    smp = torch.tensor([[-1.5, -2.0, -9.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # the third token of row 0 is not trained
    d = sampler_drift(pol, smp, mask)
    r = [0.5, 0.0, 0.25]  # policy - sampler on the three trained tokens
    assert d["drift/logratio_mean"] == pytest.approx(0.75 / 3, abs=1e-7)  # float32 sums: 1e-7 bound
    assert d["drift/kl"] == pytest.approx(sum(math.exp(x) - 1 - x for x in r) / 3, abs=1e-7)  # 0.0708
    same = sampler_drift(pol, pol, mask)
    assert same == {"drift/logratio_mean": 0.0, "drift/kl": 0.0}


def _drift_rows(tmp_path, name, k):
    run = tmp_path / name
    r = run_cli(["train", *TINY_WORLD, *FAST, "objective=grpo", "data=online", "train.steps=4", "eval.n_prompts=8",
                 "data.n=4", "train.checkpoint_every=0", "train.save_model=false", f"data.generate_every={k}",
                 f"hydra.run.dir={run}"], tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [row for row in rows if "loss" in row]


def test_drift_is_zero_on_policy_and_grows_with_staleness(cache_dir, tmp_path):
    k1 = _drift_rows(tmp_path, "k1", 1)
    k4 = _drift_rows(tmp_path, "k4", 4)
    assert len(k1) == len(k4) == 4 and all("drift/logratio_mean" in r and "drift/kl" in r for r in k1 + k4)
    # K=1: every step trains on a round sampled by the very weights it updates (the sampler's incremental
    # forward vs the trainer's full forward: float32 round-off, well under 1e-4 nats per token)
    assert all(abs(r["drift/logratio_mean"]) < 1e-4 and r["drift/kl"] < 1e-6 for r in k1)
    # K=4: one round for four steps at lr 1e-3: step 1 is on-policy, the later steps train a policy 1-3 updates
    # away from its sampler (each step sees other groups of the round, so the per-step value is not monotone)
    kl = [r["drift/kl"] for r in k4]
    assert abs(k4[0]["drift/logratio_mean"]) < 1e-4 and kl[0] < 1e-6
    # a step whose groups are all tied (every reward equal: zero advantage) has no gradient and leaves the policy
    # where it was, so a stale step may show no drift yet; once the policy has moved, the drift is far above K=1's
    assert max(kl[1:]) > 1e-3 > 1000 * max(r["drift/kl"] for r in k1)
    assert [r["online/round"] for r in k4] == [1, 1, 1, 1]
