"""The reference log-prob cache (train.reference_cache, plain offline runs): a known sequence skips the
reference forward and gets back exactly the numbers first computed for it, in any batch; the cached
training run equals the uncached one bitwise until the first repeated example and to float32 rounding
after; a moving reference is never cached; the real CLI run logs its hit fraction."""
from __future__ import annotations

import json
import random
from types import SimpleNamespace

import pytest
import torch

from humanline_cli.backend import make_backend
from humanline_cli.config import TrainSpec
from humanline_cli.core.batches import PairBatch
from humanline_cli.core.humanline import HumanlineSpec, ReferenceRule
from humanline_cli.core.logprobs import PolicyForward
from humanline_cli.core.reference import CachedReference, FrozenCopy
from humanline_cli.data.collate import make_seqs
from humanline_cli.sources.offline import OfflineSource
from humanline_cli.train.build import Parts
from humanline_cli.train.timing import PhaseTimer
from humanline_cli.train.tracking import Tracker
from humanline_cli.train.trainer import train
from tests.helpers.models import spread_llama
from tests.helpers.numerics import RUN_REL, assert_same_rows, max_weight_diff

pytestmark = pytest.mark.usefixtures("one_thread")


class CountingReference(FrozenCopy):
    def __init__(self, policy):
        super().__init__(policy)
        self.rows = 0  # sequences the model ran on

    def logps(self, seqs):
        self.rows += len(seqs)
        return super().logps(seqs)


def _units(n=8, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        prompt = [1] + [rng.randrange(3, 64) for _ in range(rng.randrange(2, 6))]
        chosen = [rng.randrange(3, 64) for _ in range(rng.randrange(1, 9))] + [2]
        rejected = [rng.randrange(3, 64) for _ in range(rng.randrange(1, 9))] + [2]
        out.append((prompt, chosen, rejected))
    return out


def _collate(units, partners=None):
    prompts = [u[0] for u in units] * 2
    return PairBatch(make_seqs(prompts, [u[1] for u in units] + [u[2] for u in units], pad_id=0))


def test_known_sequences_skip_the_forward_and_get_the_first_numbers_in_any_batch():
    model = spread_llama(vocab=64, hidden=64).eval()
    inner = CountingReference(model)
    cache = CachedReference(inner)
    units = _units(6)
    a = _collate(units[:4]).seqs
    first = cache.logps(a)
    assert torch.equal(first, FrozenCopy(model).logps(a)) and inner.rows == 8  # a miss is the plain forward
    again = cache.logps(a)
    assert torch.equal(again, first) and inner.rows == 8  # all known: no forward at all
    assert cache.hits == 8 and cache.misses == 8
    # units 2 and 3 again, now with 4 and 5 (other padding width, other company): the forward runs
    # for the batch, and the known rows get their first-computed values bitwise
    b = _collate(units[2:6]).seqs
    mixed = cache.logps(b)
    assert inner.rows == 16 and cache.misses == 12
    for i_b, i_a in ((0, 2), (1, 3), (4, 6), (5, 7)):  # rows: chosen 2,3 and rejected 2,3
        n = int(b.loss_mask[i_b].sum())
        got, want = mixed[i_b][b.loss_mask[i_b, 1:]], first[i_a][a.loss_mask[i_a, 1:]]
        assert n == len(want) and torch.equal(got, want)
    assert torch.count_nonzero(mixed[~b.loss_mask[:, 1:]]) == 0  # zero off the completion, as uncached
    # a sequence with the same tokens but another prompt/completion split is another key
    moved = make_seqs([units[0][0] + units[0][1][:1]], [units[0][1][1:]], pad_id=0)
    cache.logps(moved)
    assert cache.misses == 13
    assert cache.stats()["reference_cache/sequences"] == 13


def test_a_cached_reference_refuses_to_move():
    cache = CachedReference(FrozenCopy(spread_llama(vocab=64, hidden=64)))
    with pytest.raises(RuntimeError, match="fixed reference only"):
        cache.sync(cache.model)


def _run(tmp_path, cached: bool, steps=6):
    policy = spread_llama(vocab=64, hidden=64, seed=3, dtype=torch.float64)  # float64: compared to 1e-9 below
    reference = FrozenCopy(policy)
    if cached:
        reference = CachedReference(reference)
    source = OfflineSource(_units(8), _collate, batch_size=4, micro_batch_size=2, seed=0)  # 2 steps per epoch
    parts = Parts(make_backend("cpu", "fp64"), None, None, policy, reference, source, None, None,
                  PolicyForward(policy))
    tr = TrainSpec(steps=steps, batch_size=4, micro_batch_size=2, lr=1e-2, weight_decay=0.0, warmup_ratio=0.0,
                   schedule="constant", max_grad_norm=1.0, max_length=32, max_prompt_length=8, log_every=1,
                   save_model=False)
    spec = SimpleNamespace(train=tr, humanline=HumanlineSpec(), objective_cfg=SimpleNamespace(name="dpo", beta=0.1),
                           regime="offline", eval_cfg=SimpleNamespace(every=0))
    tmp_path.mkdir()
    tracker = Tracker(tmp_path, {}, {"mode": "disabled"}, "t")
    train(spec.train, spec.humanline, parts, objective=spec.objective_cfg,
          rule=ReferenceRule.from_spec(spec.humanline, spec.regime), tracker=tracker, timer=PhaseTimer())
    tracker.finish()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return policy, reference, [r for r in rows if "loss" in r]


def test_cached_run_equals_the_uncached_run(tmp_path):
    p0, _, plain = _run(tmp_path / "plain", cached=False)
    p1, cache, cached = _run(tmp_path / "cached", cached=True)
    assert [r["step"] for r in cached] == list(range(1, 7))
    # epoch 1 (steps 1-2): nothing repeats yet, every number is the uncached one, bitwise
    for a, b in zip(plain[:2], cached[:2]):
        assert a["loss"] == b["loss"] and a["grad_norm"] == b["grad_norm"]
    # epochs 2-3: the reference forward is skipped, and the uncached run recomputes each sequence in
    # another micro-batch (other padding, other summation order): rounding is the only difference, float64
    assert_same_rows(plain[2:], cached[2:])  # relative 1e-9 (numerics.py)
    # per step: epoch 1 computes every sequence, epochs 2 and 3 find every one in the cache
    assert [r["reference_cache/hit_fraction"] for r in cached] == [0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert cache.misses == 16 and cache.hits == 32
    assert cache.stats() == {"reference_cache/hit_fraction": 32 / 48, "reference_cache/sequences": 16}
    assert max_weight_diff(p0.state_dict(), p1.state_dict()) < RUN_REL


def test_export_and_restore_round_trip_the_store():
    model = spread_llama(vocab=64, hidden=64).eval()
    cache = CachedReference(FrozenCopy(model))
    seqs = _collate(_units(5)).seqs
    first = cache.logps(seqs)
    keys, tensors = cache.export()
    assert len(keys) == 10 and tensors["lengths"].sum() == len(tensors["values"]) == int(seqs.loss_mask.sum())
    other = CachedReference(CountingReference(model))
    other.restore(keys, tensors)
    assert torch.equal(other.logps(seqs), first) and other.inner.rows == 0  # served from the restored store
    empty = CachedReference(FrozenCopy(model))
    empty.restore(*CachedReference(FrozenCopy(model)).export())
    assert empty.store == {}
