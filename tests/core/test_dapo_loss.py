"""objective.aggregation=dapo (TRL's loss_type=dapo, the authors' math recipe): the step's loss is the sum
of its completion tokens' losses divided by the completion tokens per optimizer step of the round the step's
data were sampled in."""
from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from humanline_cli.config import resolve
from humanline_cli.core.interfaces import Completions, SamplingParams
from humanline_cli.core.logprobs import completion_mask
from humanline_cli.core.objectives import micro_batch_weights
from humanline_cli.data.collate import Collator, Encoder
from humanline_cli.errors import UserError
from humanline_cli.sources.online import OnlineSource, RoundSpec
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.world.tokenizer import build_tokenizer
from tests.helpers.training import ObjectiveStub, length_score


class _Cfg:
    def __init__(self, name="grpo", aggregation="dapo"):
        self.name, self.aggregation = name, aggregation


def test_dapo_weights_and_loss_by_hand():
    """One process, micro-batches A (per-token losses 1, 2, 3: mean 2, 3 tokens) and B (4: mean 4, 1 token);
    the round has 5 completion tokens per step. dapo: (1 + 2 + 3 + 4) / 5 = 2.0 (weights 3/5, 1/5);
    token_mean: 10 / 4 = 2.5 (weights 3/4, 1/4). Two ranks (this rank's counts 3 and 1 of a global 8, the
    round 10 tokens per step): weights x 2 for the rank average, 0.6 and 0.2 (dapo), 0.75 and 0.25."""
    means, counts = [2.0, 4.0], [3.0, 1.0]
    dapo = micro_batch_weights(_Cfg(), counts, total=4.0, world_size=1, round_tokens_per_step=5.0)
    assert dapo == pytest.approx([0.6, 0.2], abs=1e-15)
    assert sum(w * m for w, m in zip(dapo, means)) == pytest.approx(2.0, abs=1e-15)
    mean = micro_batch_weights(_Cfg(aggregation="token_mean"), counts, 4.0, 1, round_tokens_per_step=5.0)
    assert sum(w * m for w, m in zip(mean, means)) == pytest.approx(2.5, abs=1e-15)
    assert micro_batch_weights(_Cfg(), counts, 8.0, 2, 10.0) == pytest.approx([0.6, 0.2], abs=1e-15)
    assert micro_batch_weights(_Cfg(aggregation="token_mean"), counts, 8.0, 2, 10.0) == pytest.approx(
        [0.75, 0.25], abs=1e-15)
    with pytest.raises(ValueError, match="online data"):
        micro_batch_weights(_Cfg(), counts, 4.0, 1, None)


class _LengthSampler:
    """Unit-test helper: prompt i gets n copies of "1" * (i + 1) (+ EOS), so groups differ in length."""

    def __init__(self, tok):
        self.tok = tok

    def push_weights(self, policy):
        pass

    def sleep(self):
        pass

    def generate(self, prompt_ids, params, indices=None):
        indices = list(range(len(prompt_ids))) if indices is None else indices
        texts = ["1" * (i + 1) for i in indices for _ in range(params.n)]
        ids = [self.tok(t, add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id] for t in texts]
        return Completions(params.n, ids, [[-0.5] * len(i) for i in ids], texts)

    def close(self):
        pass


def test_the_round_normaliser_is_its_tokens_per_step():
    """A stale round: 4 prompts x 2 samples, batch 2 groups, so it serves 2 steps. Prompt i's completions
    are "1" x (i + 1) + EOS = i + 2 tokens each ("1" is one token): groups of 4, 6, 8 and 10 tokens, 28 in
    all, 28 x 2 / 4 = 14 per step. Both steps carry 14; the steps' own token counts (from the collated
    masks) add up to the round's 28, so over the round dapo's step weights (tokens / 14) average 1.
    A round of one step: the normaliser is that step's own count (dapo = token_mean)."""
    tok = build_tokenizer()
    assert tok("111", add_special_tokens=False)["input_ids"] == [tok("1", add_special_tokens=False)["input_ids"][0]] * 3
    enc = Encoder(tok, 16, 32)
    rows = [{"prompt": [{"role": "user", "content": f"{i:02d}+01="}]} for i in range(4)]

    def source(batch, per_round):
        spec = RoundSpec("grpo", batch, batch, SamplingParams(n=2), prompts_per_round=per_round, min_gap=0.0, seed=0)
        return OnlineSource(rows, enc, Collator(enc, ObjectiveStub()), _LengthSampler(tok), ("len", length_score), spec,
                            timer=PhaseTimer(), policy=None)

    stale = source(batch=2, per_round=4)
    steps = [stale.next_step(1), stale.next_step(2)]
    assert [s.new_round for s in steps] == [True, False]
    assert [s.round_tokens_per_step for s in steps] == [14.0, 14.0]
    own = [sum(float(completion_mask(mb.seqs).sum()) for mb in s.micro_batches) for s in steps]
    assert sum(own) == 28.0 and all(o in (10.0, 12.0, 14.0, 16.0, 18.0) for o in own)  # two groups each
    assert stale.next_step(3).new_round  # the third step samples the next round
    one = source(batch=2, per_round=2).next_step(1)
    total = sum(float(completion_mask(mb.seqs).sum()) for mb in one.micro_batches)
    assert one.round_tokens_per_step == total == 4.0 + 6.0


def _compose(overrides):
    with initialize_config_module("conf", version_base=None):
        return compose("train", overrides=overrides)


def test_dapo_is_for_online_grpo_and_paper_math_uses_the_authors_dapo():
    assert resolve(_compose(["experiment=paper_math"])).objective_cfg.aggregation == "dapo_micro"  # the authors'
    spec = resolve(_compose(["task=arithmetic", "objective=grpo", "data=online", "objective.aggregation=dapo"]))
    assert spec.objective_cfg.aggregation == "dapo"
    assert resolve(_compose(["task=arithmetic", "objective=grpo"])).objective_cfg.aggregation == "token_mean"
    with pytest.raises(UserError, match="aggregation=dapo needs data=online"):
        resolve(_compose(["task=arithmetic", "objective=grpo", "objective.aggregation=dapo"]))
