"""What an evaluation measures against a frozen copy of the starting model besides the task's judge: how far the
policy has moved from the start (KL), and which replies the start itself prefers (a pairwise judge). A policy that
games its training reward shows as a KL that keeps growing and replies its own starting model does not prefer.

Consumes the policy (trained in place), a frozen copy of the starting model, the evaluation's prompt ids and the
policy's sampled replies (token ids and texts) beside the starting policy's replies; produces `kl_to_start` and
`model_judge` entries of an evaluation result.

KL(policy || start) per reply, estimated on the policy's own replies sampled at the evaluation's temperature T
(top_p 1): the mean over replies of sum_t [log pi_T(y_t | x, y_<t) - log pi0_T(y_t | x, y_<t)], where pi_T is
softmax(logits / T), the distribution the replies were drawn from. Each reply's sum is an unbiased estimate of the
KL between the two models' tempered reply distributions (a reply cut at max_new_tokens is a draw from the cut
distribution, whose log-ratio is the same sum). Both sides' log-probs come from one forward routine (token_logps),
so the KL at step 0 is exactly 0.
"""
from __future__ import annotations

import torch

from humanline_cli.core.batches import Seqs
from humanline_cli.core.logprobs import ForwardOptions, token_logps
from humanline_cli.data.collate import make_seqs
from humanline_cli.eval.evaluator import outcome_ci
from humanline_cli.rewards.model_judge import ModelJudge, outcome


@torch.no_grad()
def reply_logps(model: torch.nn.Module, prompts: list[list[int]], replies: list[list[int]], pad_id: int,
                temperature: float, batch_size: int = 16) -> list[float]:
    """Per reply, sum_t log softmax(logits / T)[y_t] under `model` (eval mode while it runs)."""
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        for s in range(0, len(prompts), batch_size):
            seqs = make_seqs(prompts[s:s + batch_size], replies[s:s + batch_size], pad_id)
            device = next(model.parameters()).device
            seqs = Seqs(seqs.input_ids.to(device), seqs.attention_mask.to(device), seqs.loss_mask.to(device))
            out += token_logps(model, seqs, ForwardOptions(temperature=temperature)).double().sum(dim=1).tolist()
    finally:
        model.train(was_training)
    return out


class StartChecks:
    """`policy`: the module training updates in place; `start`: a frozen copy of the starting model (KL), or None;
    `judge`: the starting model as a pairwise judge, or None. `temperature`: the evaluation's (T > 0)."""

    def __init__(self, policy: torch.nn.Module, start: torch.nn.Module | None, judge: ModelJudge | None,
                 pad_id: int, temperature: float):
        self.policy, self.start, self.judge, self.pad_id, self.temperature = policy, start, judge, pad_id, temperature
        if start is not None:
            start.requires_grad_(False).eval()

    def measure(self, prompt_ids: list[list[int]], prompt_text: list[str], replies: list[list[int]],
                texts: list[str], start_texts: list[str]) -> dict:
        out: dict = {}
        if self.start is not None:
            now = reply_logps(self.policy, prompt_ids, replies, self.pad_id, self.temperature)
            then = reply_logps(self.start, prompt_ids, replies, self.pad_id, self.temperature)
            per_reply = [a - b for a, b in zip(now, then)]
            n_tokens = sum(len(r) for r in replies)
            out["kl_to_start"] = sum(per_reply) / len(per_reply)
            out["kl_to_start_per_token"] = sum(per_reply) / n_tokens if n_tokens else 0.0
        if self.judge is not None:
            prefs = self.judge.preferences(prompt_text, texts, start_texts)
            wr, ci = outcome_ci([outcome(p) for p in prefs])
            out["model_judge"] = {"win_rate": wr, "win_rate_ci": list(ci),
                                  "preference_mean": sum(prefs) / len(prefs), "judge": self.judge.name}
        return out
