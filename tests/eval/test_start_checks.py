"""eval.kl_to_start (eval/start_checks.py): KL(policy || start) per reply on the policy's sampled replies at the
evaluation's temperature, checked against the same sum written out with full logits; exactly 0 while the
policy is the start."""
from __future__ import annotations

import copy

import pytest
import torch

from humanline_cli.eval.start_checks import StartChecks, reply_logps
from tests.helpers.models import tiny_llama


def _by_hand(model, prompt: list[int], reply: list[int], temperature: float) -> float:
    """sum over the reply's tokens of log softmax(logits / T)[y_t], one unpadded row, float64."""
    ids = torch.tensor([prompt + reply])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].double() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return sum(float(logp[len(prompt) - 1 + k, tok]) for k, tok in enumerate(reply))


def test_kl_to_start_is_the_mean_log_ratio_of_the_replies_at_the_eval_temperature():
    start = tiny_llama(0).double()
    policy = tiny_llama(1).double().train()  # another draw of the weights: a policy that has moved
    prompts = [[1, 5, 7], [1, 9], [1, 3, 4, 6]]
    replies = [[10, 11, 2], [12], [13, 14, 15, 16]]  # unequal lengths: the batch is padded
    checks = StartChecks(policy, copy.deepcopy(start), None, pad_id=0, temperature=0.7)
    out = checks.measure(prompts, ["p"] * 3, replies, ["r"] * 3, ["s"] * 3)
    per_reply = [_by_hand(policy, p, r, 0.7) - _by_hand(start, p, r, 0.7) for p, r in zip(prompts, replies)]
    assert out["kl_to_start"] == pytest.approx(sum(per_reply) / 3, abs=1e-9)
    assert out["kl_to_start_per_token"] == pytest.approx(sum(per_reply) / 8, abs=1e-9)
    assert policy.training  # the policy's mode is restored after the evaluation's forward
    assert "model_judge" not in out


def test_kl_to_start_is_exactly_zero_while_the_policy_is_the_start():
    start = tiny_llama(0)
    prompts, replies = [[1, 5, 7], [1, 9]], [[10, 11, 2], [12, 13]]
    out = StartChecks(copy.deepcopy(start), start, None, pad_id=0, temperature=0.7).measure(
        prompts, ["p", "p"], replies, ["a", "b"], ["a", "b"])
    assert out["kl_to_start"] == 0.0 and out["kl_to_start_per_token"] == 0.0
    # one forward routine for both sides: the tempered log-probs match the written-out sum (float32 bound)
    got = reply_logps(start, prompts, replies, 0, 0.7)
    assert got == pytest.approx([_by_hand(start, p, r, 0.7) for p, r in zip(prompts, replies)], abs=1e-4)
