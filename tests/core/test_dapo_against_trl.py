"""objective.aggregation=dapo against TRL's own GRPOTrainer._compute_loss (trl 1.16, loss_type="dapo"), and
objective.aggregation=dapo_micro (the authors' dapo) against the same TRL code driven as the authors' trainer
normalised, in float64: equal step loss and equal gradients with respect to every per-token log-prob, to 1e-10,
over 2 processes x 2 accumulation micro-steps with unequal completion lengths.

TRL's _compute_loss runs unchanged; its model forward (_get_per_token_logps_and_entropies) is replaced by a
stub returning the test's per-token log-probs (leaf tensors), so gradients are taken with respect to them:
equal there means equal for any model's parameters (the chain rule from the log-probs down is shared). DDP
is the mean over processes of each process's summed micro-step gradients, written out below."""
from __future__ import annotations

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from trl import GRPOTrainer

from humanline_cli.core.losses import grpo_loss
from humanline_cli.core.objectives import micro_batch_weights

EPS, BETA = 0.2, 0.04
P, G = 2, 2  # processes, gradient-accumulation micro-steps per optimizer step
B = 3        # sequences per micro-step per process


class _TRLSelf:
    """The attributes GRPOTrainer._compute_loss reads, at the values of a plain run with loss_type=dapo (no
    vLLM, no entropy mask or bonus, token-level ratios, no off-policy mask); `logps` is what the stubbed
    forward returns."""

    def __init__(self, loss_type, steps_per_generation, logps):
        self.loss_type, self.beta = loss_type, BETA
        self.epsilon_low = self.epsilon_high = EPS
        self.importance_sampling_level = "token"
        self.top_entropy_quantile, self.off_policy_mask_threshold = 1.0, None
        self.use_vllm = self.vllm_importance_sampling_correction = False
        self.aux_loss_enabled = self._entropy_bonus_enabled = False
        self.current_gradient_accumulation_steps = G
        self.args = SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=steps_per_generation)
        self.model = SimpleNamespace(training=True)
        # metrics only: each process's own values (they do not enter the loss)
        self.accelerator = SimpleNamespace(num_processes=P, gather=lambda x: x, reduce=lambda x, reduction: x)
        self._metrics = defaultdict(lambda: defaultdict(list))
        self._logps = logps

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, **kw):
        assert self._logps.shape[1] == logits_to_keep
        return self._logps, torch.zeros_like(self._logps), None


def _micro_batches(seed: int, steps: int):
    """[step][process][micro-step] dicts of float64 tensors: policy log-probs (leaf), old (generation-time) and
    reference log-probs, advantages, and a completion mask whose lengths differ within and across micro-steps
    (padded widths 4 and 9 alternate)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for s in range(steps):
        procs = []
        for p in range(P):
            mbs = []
            for m in range(G):
                width = 4 if (s + p + m) % 2 == 0 else 9
                lengths = torch.randint(1, width + 1, (B,), generator=g)
                mask = (torch.arange(width)[None, :] < lengths[:, None]).double()
                pol = (-torch.rand(B, width, generator=g, dtype=torch.float64) * 2).requires_grad_(True)
                old = pol.detach() + 0.3 * torch.randn(B, width, generator=g, dtype=torch.float64)
                ref = pol.detach() + 0.3 * torch.randn(B, width, generator=g, dtype=torch.float64)
                adv = torch.randn(B, generator=g, dtype=torch.float64)
                mbs.append(dict(pol=pol, old=old, ref=ref, adv=adv, mask=mask))
            procs.append(mbs)
        out.append(procs)
    return out


def _trl_step(step, loss_type, steps_per_generation, num_items):
    """One optimizer step through TRL's _compute_loss: num_items(p, m) is the inputs' num_items_in_batch.
    Returns the step loss (the DDP mean over processes of the summed micro-step losses) and its gradients."""
    total = 0.0
    for p, mbs in enumerate(step):
        for m, mb in enumerate(mbs):
            pol, mask = mb["pol"], mb["mask"]
            inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2),
                      "completion_ids": torch.zeros(pol.shape, dtype=torch.long), "completion_mask": mask,
                      "advantages": mb["adv"], "old_per_token_logps": mb["old"], "ref_per_token_logps": mb["ref"],
                      "num_items_in_batch": torch.tensor(num_items(p, m), dtype=torch.float64)}
            loss = GRPOTrainer._compute_loss(_TRLSelf(loss_type, steps_per_generation, pol), None, inputs)
            total = total + loss / P
    return _loss_and_grads(step, total)


def _our_step(step, aggregation, round_tokens_per_step=None):
    """One optimizer step as train/trainer.py runs it: each micro-batch's grpo_loss (ratio denominator: the
    generation-time log-probs, objective.ratio_denominator=sampler; k3 against the reference) times its
    micro_batch_weights weight, summed per process, then the DDP mean over processes."""
    cfg = SimpleNamespace(name="grpo", aggregation=aggregation)
    counts = [[float(mb["mask"].sum()) for mb in mbs] for mbs in step]
    total_tokens = sum(map(sum, counts))
    micro_totals = [sum(counts[p][m] for p in range(P)) for m in range(G)]
    total = 0.0
    for p, mbs in enumerate(step):
        weights = micro_batch_weights(cfg, counts[p], total_tokens, P, round_tokens_per_step, micro_totals=micro_totals)
        for mb, w in zip(mbs, weights):
            pol = mb["pol"]
            loss, _ = grpo_loss(pol - mb["old"], pol - mb["ref"], mb["mask"], mb["adv"], EPS, BETA, aggregation)
            total = total + loss * w / P
    return _loss_and_grads(step, total)


def _loss_and_grads(step, total):
    leaves = [mb["pol"] for mbs in step for mb in mbs]
    grads = torch.autograd.grad(total, leaves)
    return float(total.detach()), grads


def _tokens(step) -> float:
    return sum(float(mb["mask"].sum()) for mbs in step for mb in mbs)


def _assert_same(ours, trl):
    assert ours[0] == pytest.approx(trl[0], rel=0, abs=1e-10)
    assert len(ours[1]) == len(trl[1]) == P * G
    for a, b in zip(ours[1], trl[1]):
        assert torch.allclose(a, b, rtol=0, atol=1e-10)
    assert any(float(g.abs().max()) > 1e-3 for g in trl[1])  # the gradients compared are not all zero


def test_dapo_equals_trl_one_generation_per_step():
    """steps_per_generation = gradient_accumulation_steps (TRL's default, our data.generate_every=1): TRL's
    normaliser is num_items_in_batch (the step's completion tokens over all processes) / P x G / S = the
    step's tokens / P; ours divides by the round's tokens per step, here the step's own count."""
    step = _micro_batches(0, 1)[0]
    n = _tokens(step)
    trl = _trl_step(step, "dapo", G, lambda p, m: n)
    ours = _our_step(step, "dapo", round_tokens_per_step=n)
    _assert_same(ours, trl)
    # and it is the step's global token mean: the same number token_mean gives
    assert _our_step(step, "token_mean")[0] == pytest.approx(trl[0], rel=0, abs=1e-10)


def test_dapo_equals_trl_on_a_stale_generation():
    """A generation serving 2 optimizer steps (steps_per_generation = 2 G, our data.generate_every=2):
    num_items_in_batch counts the whole generation's tokens; TRL's normaliser is that x G / S = the
    generation's mean tokens per step, which is our round_tokens_per_step. The two steps have different
    token counts, so each step's loss is its token sum over the round's mean, not its own token mean."""
    steps = _micro_batches(1, 2)
    n_gen = sum(_tokens(s) for s in steps)
    assert _tokens(steps[0]) != _tokens(steps[1])
    for step in steps:
        trl = _trl_step(step, "dapo", 2 * G, lambda p, m: n_gen)
        ours = _our_step(step, "dapo", round_tokens_per_step=n_gen / 2)
        _assert_same(ours, trl)
        assert abs(ours[0] - _our_step(step, "token_mean")[0]) > 1e-4  # not the step's token mean


def test_dapo_micro_equals_the_authors_normalisation():
    """The authors' loss (open-r1-humanline's _compute_loss on trl 0.18 / transformers 4.52.3): micro-step m's
    process-local token sum / (N_m / P), N_m = micro-step m's completion tokens over all processes, then the
    trainer divides by G (trl 0.18 sets model_accepts_loss_kwargs=False). It is TRL 1.16's dapo code with
    num_items_in_batch = N_m and steps_per_generation = 1 (normaliser N_m / P x G / 1), which runs here.
    It differs from TRL's current dapo whenever micro-steps carry different token counts."""
    step = _micro_batches(2, 1)[0]
    n_m = [sum(float(step[p][m]["mask"].sum()) for p in range(P)) for m in range(G)]
    assert n_m[0] != n_m[1]
    trl_authors = _trl_step(step, "dapo", 1, lambda p, m: n_m[m])
    ours = _our_step(step, "dapo_micro")
    _assert_same(ours, trl_authors)
    trl_now = _trl_step(step, "dapo", G, lambda p, m: _tokens(step))
    assert abs(ours[0] - trl_now[0]) > 1e-4


def test_dapo_micro_weights_by_hand():
    """2 ranks, 2 micro-steps. This rank's counts 3 and 1 tokens; micro-step token counts over both ranks
    N = 5 and 2: w = 3/5/2 x 2 = 0.6 and 1/2/2 x 2 = 0.5. Per-token losses of micro-step 1: this rank 1, 2, 3
    (mean 2), the other rank 4, 5 (sum 9); micro-step 2: this rank 6, the other 2 (sum 2). The authors'
    step loss (1/G) sum_m (global token sum / N_m) = ((6 + 9) / 5 + (6 + 2) / 2) / 2 = (3 + 4) / 2 = 3.5;
    the DDP mean of the ranks' weighted sums: this rank 0.6 x 2 + 0.5 x 6 = 4.2, the other (counts 2, 1,
    means 4.5, 2) 2/5/2 x 2 x 4.5 + 1/2/2 x 2 x 2 = 1.8 + 1.0 = 2.8; (4.2 + 2.8) / 2 = 3.5. A micro-step
    with no token on any rank (a filler everywhere) weighs 0 and is not counted in G."""
    cfg = SimpleNamespace(name="grpo", aggregation="dapo_micro")
    mine = micro_batch_weights(cfg, [3.0, 1.0], 7.0, 2, micro_totals=[5.0, 2.0])
    other = micro_batch_weights(cfg, [2.0, 1.0], 7.0, 2, micro_totals=[5.0, 2.0])
    assert mine == pytest.approx([0.6, 0.5], abs=1e-15)
    step_loss = (mine[0] * 2.0 + mine[1] * 6.0 + other[0] * 4.5 + other[1] * 2.0) / 2
    assert step_loss == pytest.approx(3.5, abs=1e-12)
    assert micro_batch_weights(cfg, [3.0, 0.0], 3.0, 1, micro_totals=[3.0, 0.0]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="each micro-step"):
        micro_batch_weights(cfg, [3.0, 1.0], 4.0, 1)


def test_dapo_micro_through_the_trainer(cache_dir, tmp_path):
    """The trainer wiring (train/trainer.py passes each micro-step's token count over all ranks): with the step
    in one micro-batch (G = 1, N_1 = the step's tokens) dapo_micro is the step's token mean, so the run equals
    aggregation=token_mean bitwise (the weight c / N_1 / 1 x 1 is the same float as c / total x 1). (This tiny
    world's completions all have one length, so micro-steps of unequal counts are left to the tests above.)"""
    import json

    from safetensors.torch import load_file

    from tests.helpers.cli import FAST, TINY_WORLD, run_cli

    def train(name, *extra):
        run = tmp_path / name
        r = run_cli(["train", *TINY_WORLD, *FAST, "objective=grpo", "data=online", "train.steps=2", "data.n=4",
                     "eval.n_prompts=8", "train.checkpoint_every=0", f"hydra.run.dir={run}", *extra], tmp_path)
        assert r.returncode == 0, r.stderr[-2000:]
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return [m["loss"] for m in rows if "loss" in m], load_file(str(run / "model" / "model.safetensors"))

    mean_loss, mean_w = train("token_mean", "train.micro_batch_size=8")
    one_loss, one_w = train("dapo_micro_1", "train.micro_batch_size=8", "objective.aggregation=dapo_micro")
    assert len(one_loss) == 2 and one_loss == mean_loss and all(mean_w[k].equal(one_w[k]) for k in mean_w)
