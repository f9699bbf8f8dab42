"""The loop's invariants on a tiny locally built Llama: DPO loss is ln 2 at step 1, the humanline
reference equals the pre-step weights after every step (k = 1) or every k-th step, the plain
reference never moves, plain online resets it each round, and a NaN loss stops the run."""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from humanline_cli.backend import make_backend
from humanline_cli.config import TrainSpec
from humanline_cli.core.batches import PairBatch
from humanline_cli.core.humanline import HumanlineSpec, ReferenceRule
from humanline_cli.core.interfaces import StepData
from humanline_cli.core.logprobs import PolicyForward
from humanline_cli.core.reference import FrozenCopy
from humanline_cli.data.collate import make_seqs
from humanline_cli.errors import RunFailed
from humanline_cli.train.build import Parts
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import Tracker
from humanline_cli.train.trainer import train
from tests.helpers.models import tiny_llama


def trainer_llama(seed=0):
    return tiny_llama(seed, vocab_size=32, hidden_size=64, intermediate_size=128, head_dim=32,
                      max_position_embeddings=32, tie_word_embeddings=True).train()


class SnapshotSource:
    """Yields the same DPO batch each step and records the policy's weights at the start of each
    step, i.e. the pre-step weights of that step's optimizer update."""

    def __init__(self, policy, new_round_every=0):
        self.policy, self.snaps, self.every = policy, {}, new_round_every
        g = torch.Generator().manual_seed(1)
        prompts = [[1, 5, 6], [1, 7, 8, 9]]
        chosen = [torch.randint(10, 32, (4,), generator=g).tolist() + [2] for _ in prompts]
        rejected = [torch.randint(10, 32, (3,), generator=g).tolist() + [2] for _ in prompts]
        self.batch = PairBatch(make_seqs(prompts * 2, chosen + rejected, pad_id=0))

    def next_step(self, step):
        self.snaps[step] = {k: v.detach().clone() for k, v in self.policy.state_dict().items()}
        return StepData([self.batch], new_round=bool(self.every) and (step - 1) % self.every == 0)

    def describe(self):
        return "snapshot"


def _spec(steps, hl=HumanlineSpec(), beta=0.1, online=False):
    tr = TrainSpec(steps=steps, batch_size=2, micro_batch_size=2, lr=1e-2, weight_decay=0.0, warmup_ratio=0.0,
                   schedule="constant", max_grad_norm=1.0, max_length=32, max_prompt_length=8, log_every=1,
                   save_model=False)
    return SimpleNamespace(train=tr, humanline=hl, objective_cfg=SimpleNamespace(name="dpo", beta=beta),
                           regime="online" if online else "offline", eval_cfg=SimpleNamespace(every=0))


def _run(tmp_path, steps, hl=HumanlineSpec(), beta=0.1, resets=False, round_every=0):
    policy = trainer_llama()
    reference = FrozenCopy(policy)
    start = {k: v.clone() for k, v in policy.state_dict().items()}
    source = SnapshotSource(policy, round_every)
    parts = Parts(make_backend("cpu", "fp32"), None, None, policy, reference, source, None, None,
                  PolicyForward(policy))
    tracker = Tracker(tmp_path, {}, {"mode": "disabled"}, "t")
    spec = _spec(steps, hl, beta, online=resets)
    train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
          rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=tracker, timer=PhaseTimer())
    tracker.finish()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return policy, reference, start, source.snaps, rows


def _equal(model, sd):
    return all(torch.equal(v, sd[k]) for k, v in model.state_dict().items())


def test_dpo_loss_is_ln2_at_step_one_and_learns(tmp_path):
    policy, reference, start, _, rows = _run(tmp_path, 3)
    # policy == reference: log-ratios exactly 0, so the loss is float32's ln 2 (within one ulp, 6e-8)
    assert rows[0]["step"] == 1 and rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert rows[-1]["loss"] < math.log(2)  # the policy moved towards the chosen completions
    assert _equal(reference.model, start) and not _equal(policy, start)  # plain: the reference never moves


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_humanline_reference_equals_pre_step_weights(tmp_path, steps):
    policy, reference, start, snaps, rows = _run(tmp_path, steps, HumanlineSpec(clamp=True, sync=True))
    assert _equal(reference.model, snaps[steps])  # the weights the last optimizer.step started from
    assert not _equal(policy, snaps[steps])
    # step 1 has policy == reference, so the loss is ln 2 with or without humanline
    assert rows[0]["loss"] == pytest.approx(math.log(2), abs=1e-7)
    assert 0.0 < rows[0]["humanline/unclamped_fraction"] <= 1.0


def test_sync_every_k(tmp_path):
    _, reference, _, snaps, _ = _run(tmp_path, 5, HumanlineSpec(sync=True, sync_every=2))
    assert _equal(reference.model, snaps[4]) and not _equal(reference.model, snaps[5])


def test_plain_online_resets_reference_each_round(tmp_path):
    _, reference, start, snaps, _ = _run(tmp_path, 5, resets=True, round_every=2)  # rounds start at 1, 3, 5
    assert _equal(reference.model, snaps[5]) and not _equal(reference.model, start)


def test_nan_loss_stops_the_run(tmp_path):
    with pytest.raises(RunFailed, match="loss is nan at step 1"):
        _run(tmp_path, 2, beta=float("nan"))
