"""train.packing and train.length_bucketing: packed token_logps equals the padded one (values and gradients,
chunked and full-logits routes, tied embeddings), so do DPO/KTO/GRPO losses and gradients; a model that
ignores per-sequence position ids is refused in one line; bucketing sorts each rank's share without
changing the step's gradient or KTO's partners; padding_efficiency on a long-tailed length
distribution; and a short real run with packing logs the same losses as without."""
from __future__ import annotations

import random
from dataclasses import fields

import pytest
import torch

from humanline_cli import schema as S
from humanline_cli.core.batches import BinaryBatch, GroupBatch, PairBatch, Seqs
from humanline_cli.core.humanline import HumanlineSpec
from humanline_cli.core.logprobs import (
    PLAIN,
    ForwardOptions,
    PolicyForward,
    _decoder_and_head,
    check_packing,
    pack_seqs,
    packing_probe,
    runs_packed,
    token_logps,
)
from humanline_cli.core.objectives import compute_loss, loss_count, step_z0
from humanline_cli.core.packing import padding_efficiency
from humanline_cli.core.reference import FrozenCopy
from humanline_cli.data.collate import Collator, Encoder, make_seqs
from humanline_cli.data.examples import BinaryExample, GroupExample
from humanline_cli.errors import UserError
from humanline_cli.sources.offline import OfflineSource
from humanline_cli.sources.source import Shard, micro_batches
from tests.helpers.cli import FAST, TINY_WORLD, run_in_process
from tests.helpers.models import spread_llama, tiny_llama
from tests.helpers.numerics import FP64, PADDED, assert_same, assert_same_rows, close, random_seqs, values_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


PACK = ForwardOptions(pack=True)


class NoSplit(torch.nn.Module):
    """Forwards to the model but exposes no decoder/head split (like a DDP wrapper): the full-logits route."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, **kwargs):
        return self.lm(**kwargs)


# ------------------------------------------------------------------ (a) token_logps packed == padded
@pytest.mark.parametrize("route", ["chunked", "chunked-1", "full-logits", "tied"])
def test_packed_token_logps_values_and_gradients_equal_padded(route):
    model = spread_llama(tie=route == "tied", seed=11, dtype=torch.float64)  # float64: close() is relative 1e-10
    seqs = random_seqs(64, n=6, seed=12)
    chunk = 1 if route == "chunked-1" else None
    target = NoSplit(model) if route == "full-logits" else model
    assert (_decoder_and_head(target) is None) == (route == "full-logits")
    pad = values_and_grads(lambda m, s: token_logps(m, s, chunk_size=chunk), target, seqs)
    pk = values_and_grads(lambda m, s: token_logps(m, s, PACK, chunk_size=chunk), target, seqs)
    assert_same(pk, pad)
    assert torch.all(pk[0][seqs.loss_mask[:, 1:] == 0] == 0) and pk[0].shape == pad[0].shape
    with torch.no_grad():  # and without grad (the reference's call)
        assert close(token_logps(target, seqs, PACK), token_logps(target, seqs))


def test_packed_forward_is_one_padding_free_row_with_restarting_positions():
    model = spread_llama(seed=13)
    seqs = random_seqs(64, n=5, seed=14)
    lengths = seqs.attention_mask.sum(1).tolist()
    calls = []
    model.get_decoder().register_forward_pre_hook(lambda mod, args, kw: calls.append(dict(kw)), with_kwargs=True)
    token_logps(model, seqs, PACK)  # one decoder call: the packing check is a setup step of its own
    assert len(calls) == 1
    check_packing(model, seqs)  # the setup step: packed and padded, once each
    assert len(calls) == 3
    token_logps(model, seqs, PACK)
    assert len(calls) == 4
    kw = calls[-1]
    assert kw.get("attention_mask") is None and kw["input_ids"].shape == (1, sum(lengths))
    assert kw["position_ids"][0].tolist() == [t for n in lengths for t in range(n)]
    ids, pos, index = pack_seqs(seqs)
    real = seqs.attention_mask.bool()
    assert torch.equal(ids[0][index[real]], seqs.input_ids[real])  # index maps (row, col) -> packed position
    offsets = [sum(lengths[:i]) for i in range(len(lengths))]
    for i, n in enumerate(lengths):
        assert index[i, :n].tolist() == list(range(offsets[i], offsets[i] + n))


def test_seqs_carry_only_data_and_the_options_live_with_the_models():
    """Packing is how the policy's and the reference's forwards run (the builder gives both the run's options),
    never a flag on the batch: Seqs holds its three tensors and nothing else."""
    assert [f.name for f in fields(Seqs)] == ["input_ids", "attention_mask", "loss_mask"]
    model = spread_llama(seed=13)
    assert PolicyForward(model).options == PLAIN and FrozenCopy(model).options == PLAIN
    assert PolicyForward(model, PACK).unwrapped() == PolicyForward(model, PACK)  # no DDP wrapper: the same


def test_prompt_learning_models_are_not_packed():
    import peft  # installed by `just setup` (test extra): a missing peft is a failure, not a skip
    pm = peft.get_peft_model(spread_llama(seed=15), peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=2))
    seqs = random_seqs(64, seed=16)
    assert not runs_packed(pm, seqs, PACK) and runs_packed(spread_llama(seed=15), seqs, PACK)
    assert not runs_packed(spread_llama(seed=15), seqs, PLAIN)


# ------------------------------------------------------------------ (b) losses through compute_loss
def _pair_batch():
    g = torch.Generator().manual_seed(21)
    prompts = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (3, 6, 2)]
    chosen = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (5, 1, 9)]
    rejected = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (2, 7, 4)]
    return PairBatch(make_seqs(prompts * 2, chosen + rejected, pad_id=0))


def _binary_batch():
    seqs = random_seqs(64, n=6, seed=22)
    g = torch.Generator().manual_seed(23)
    prompts = [seqs.input_ids[i][: int(seqs.loss_mask[i].nonzero()[0])].tolist() if seqs.loss_mask[i].any()
               else seqs.input_ids[i][: int(seqs.attention_mask[i].sum())].tolist() for i in range(6)]
    shifted = [torch.randint(1, 64, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
               for _ in range(6)]
    return BinaryBatch(seqs, torch.tensor([True, False, True, True, False, False]),
                       make_seqs(prompts, shifted, pad_id=0))


def _group_batch():
    seqs = random_seqs(64, n=6, seed=24)
    return GroupBatch(seqs, torch.tensor([1.0, -0.5, 0.25, -1.0, 0.75, -0.5]))


OBJECTIVES = {"dpo": (S.DPOConfig(), _pair_batch), "kto": (S.KTOConfig(), _binary_batch),
              "grpo": (S.GRPOConfig(beta=0.05), _group_batch)}


def _loss_and_grads(cfg, policy: PolicyForward, reference, batch, hl):
    policy.module.zero_grad(set_to_none=True)
    loss, metrics = compute_loss(cfg, policy, reference, batch, hl)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in policy.module.named_parameters()}, metrics


@pytest.mark.parametrize("objective", ["dpo", "kto", "grpo"])
def test_losses_and_gradients_packed_equal_padded(objective):
    cfg, make = OBJECTIVES[objective]
    policy = spread_llama(seed=25, dtype=torch.float64)  # float64: close() is relative 1e-10
    reference = FrozenCopy(policy)
    with torch.no_grad():  # move the policy off the reference so the log-ratios are not all zero
        g = torch.Generator().manual_seed(26)
        for p in policy.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    hl = HumanlineSpec(clamp=True, log_eps_P=-0.5, log_eps_R=0.5)
    batch = make()
    packed_reference = FrozenCopy(policy, reference.model, PACK)  # the same frozen weights, run packed
    loss_a, grads_a, m_a = _loss_and_grads(cfg, PolicyForward(policy), reference, batch, hl)
    loss_b, grads_b, m_b = _loss_and_grads(cfg, PolicyForward(policy, PACK), packed_reference, batch, hl)
    assert close(loss_b, loss_a), (float(loss_a), float(loss_b))
    assert abs(float(loss_a)) > 1e-3 and grads_a.keys() == grads_b.keys()
    for k in grads_a:
        assert close(grads_b[k], grads_a[k]), (k, float((grads_b[k] - grads_a[k]).abs().max()))
    assert m_a["logratio_mean"] == pytest.approx(m_b["logratio_mean"], abs=1e-12)  # float64, |x| < 1
    assert 0.0 < m_a["humanline/unclamped_fraction"] < 1.0  # the clamp is in play
    assert m_a["humanline/unclamped_fraction"] == m_b["humanline/unclamped_fraction"]
    seqs = batch.seqs
    assert m_a["_n_tokens"] == m_b["_n_tokens"] == float(seqs.attention_mask.sum())
    assert m_a["_n_processed"] == seqs.input_ids.numel() and m_b["_n_processed"] == m_b["_n_tokens"]


# ------------------------------------------------------------------ (c) padding efficiency
def test_padding_efficiency_on_a_long_tailed_length_distribution():
    rng = random.Random(0)
    lengths = [min(1024, max(8, round(rng.lognormvariate(4.5, 1.0)))) for _ in range(512)]
    assert min(lengths) == 8 and max(lengths) == 1024  # both clips are hit: a long tail
    micro = 8
    pk = padding_efficiency(lengths, micro, packing=True, bucketing=False)
    bucketed = padding_efficiency(lengths, micro, packing=False, bucketing=True)
    padded = padding_efficiency(lengths, micro, packing=False, bucketing=False)
    print(f"\npadding_efficiency (512 lognormal lengths 8..1024, micro={micro}): packed {pk:.3f}, "
          f"bucketed {bucketed:.3f}, padded {padded:.3f}")
    assert pk >= 0.95
    assert bucketed > padded
    assert 0.0 < padded < 0.6 and bucketed > 0.8  # the numbers printed above, with margin
    assert padding_efficiency([5, 5, 5], 2, packing=False, bucketing=False) == 1.0
    assert padding_efficiency([1, 3], 2, packing=False, bucketing=False) == pytest.approx(4 / 6)


# ------------------------------------------------------------------ (d) length bucketing
def _world_collator(objective_cfg, bucketing=True):
    from humanline_cli.world.tokenizer import build_tokenizer

    return Collator(Encoder(build_tokenizer(), max_prompt_length=16, max_length=40), objective_cfg, bucketing)


def test_the_builder_gives_the_forward_options_to_the_models_and_buckets_only_unpacked_runs():
    """train.packing and train.shared_prefix reach the policy's and the reference's forwards (forward_options), and
    the collator buckets by length only without packing (packed micro-batches hold no padding)."""
    from hydra import compose, initialize_config_module

    from humanline_cli.config import resolve
    from humanline_cli.train.build import forward_options, make_collator
    from humanline_cli.world.tokenizer import build_tokenizer

    enc = Encoder(build_tokenizer(), max_prompt_length=16, max_length=40)
    for packing, shared in ((False, True), (True, True), (False, False)):
        with initialize_config_module(config_module="conf", version_base="1.3"):
            spec = resolve(compose("train", overrides=[
                "task=custom", "data.path=unused.jsonl", f"train.packing={str(packing).lower()}",
                f"train.shared_prefix={str(shared).lower()}"]))
        assert forward_options(spec) == ForwardOptions(pack=packing, share_prefix=shared, temperature=1.0)
        assert (make_collator(spec, enc).bucket_length is None) == packing


def _units(objective: str, n: int = 8):
    rng = random.Random(31)
    digits = "0123456789"

    def text(k):
        return "".join(rng.choice(digits) for _ in range(k))

    prompts = [f"{text(rng.randint(1, 4))}+{text(rng.randint(1, 4))}=" for _ in range(n)]
    if objective == "kto":
        return [BinaryExample(p, text(rng.randint(1, 30)), rng.random() < 0.5) for p in prompts]
    return [GroupExample(p, [text(rng.randint(1, 30)) for _ in range(3)], [rng.random() for _ in range(3)])
            for p in prompts]


def _step_grads(cfg, policy, reference, mbs, hl):
    """The trainer's step: KTO z0 over the step, each micro-batch's loss weighted by its share."""
    policy.zero_grad(set_to_none=True)
    z0 = step_z0(cfg, PolicyForward(policy), reference, mbs, hl)
    counts = [loss_count(cfg, mb) for mb in mbs]
    for mb, c in zip(mbs, counts):
        loss, _ = compute_loss(cfg, PolicyForward(policy), reference, mb, hl, z0=z0)
        (loss * c / sum(counts)).backward()
    return {k: p.grad.clone() for k, p in policy.named_parameters()}


@pytest.mark.parametrize("objective", ["kto", "grpo"])
def test_bucketing_keeps_the_step_gradient_and_kto_partners(objective):
    cfg = S.KTOConfig() if objective == "kto" else S.GRPOConfig(beta=0.05)
    collate = _world_collator(cfg)
    assert collate.bucket_length == collate.length
    assert _world_collator(cfg, bucketing=False).bucket_length is None
    units = _units(objective)
    seen = []

    def recording(mine, theirs):
        seen.append((mine, theirs))
        return collate(mine, theirs)

    plain = micro_batches(units, recording, 2)
    plain_calls, seen[:] = list(seen), []
    bucketed = micro_batches(units, recording, 2, length=collate.length)
    lengths = [collate.length(u) for u in units]
    assert len(set(lengths)) > 4
    order = [u for mine, _ in seen for u in mine]
    assert [collate.length(u) for u in order] == sorted(lengths, reverse=True) and order != units
    # every unit keeps its partner: the next unit of the global batch
    partner = {id(u): units[(i + 1) % len(units)] for i, u in enumerate(units)}
    for calls in (plain_calls, seen):
        assert all(p is partner[id(u)] for mine, theirs in calls for u, p in zip(mine, theirs))
    if objective == "kto":  # the collated mismatched sequences too: prompt of the unit, completion of its partner
        for mb, (mine, theirs) in zip(bucketed, seen):
            ref = collate._seqs([u.prompt for u in mine], [p.completion for p in theirs])
            assert torch.equal(mb.kl_seqs.input_ids, ref.input_ids)
    # each sequence's rows are as collated: the longest row of a unit is its length
    for mb, (mine, _) in zip(bucketed, seen):
        assert mb.seqs.input_ids.shape[1] == max(collate.length(u) for u in mine)
    # less padding, the same gradient
    processed = [sum(mb.seqs.input_ids.numel() for mb in mbs) for mbs in (plain, bucketed)]
    assert processed[1] < processed[0]
    if objective == "kto":  # one sequence per unit: padding_efficiency predicts the collated batches exactly
        useful = sum(int(mb.seqs.attention_mask.sum()) for mb in plain)
        assert useful / processed[0] == pytest.approx(padding_efficiency(lengths, 2, False, False))
        assert useful / processed[1] == pytest.approx(padding_efficiency(lengths, 2, False, True))
    policy = spread_llama(seed=32, dtype=torch.float64)  # float64: close() is relative 1e-10
    reference = FrozenCopy(policy)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hl = HumanlineSpec()
    a, b = _step_grads(cfg, policy, reference, plain, hl), _step_grads(cfg, policy, reference, bucketed, hl)
    for k in a:
        assert close(b[k], a[k]), (k, float((b[k] - a[k]).abs().max()))
    # ranks: each sorts its own contiguous share; partners still come from the global batch
    second = []
    micro_batches(units, lambda m, t: second.append((m, t)), 2, Shard(1, 2), length=collate.length)
    share = [u for m, _ in second for u in m]
    assert {id(u) for u in share} == {id(u) for u in units[4:]}
    assert all(p is partner[id(u)] for m, t in second for u, p in zip(m, t)) and partner[id(units[7])] is units[0]
    # deterministic (resume replays the same micro-batches) and wired through the offline source
    src = OfflineSource(units, lambda m, t: [collate.length(u) for u in m], 8, 2, seed=0, length=collate.length)
    got = [x for mb in src.next_step(1).micro_batches for x in mb]
    assert got == sorted(got, reverse=True)


# ------------------------------------------------------------------ (e) models that ignore packing
class _DropPositions(torch.nn.Module):
    def __init__(self, decoder):
        super().__init__()
        self.decoder = decoder

    def forward(self, position_ids=None, **kwargs):
        return self.decoder(**kwargs)


class PositionBlindLM(torch.nn.Module):
    """A causal LM whose decoder drops position_ids: packed, its sequences would attend to each other."""

    def __init__(self, lm):
        super().__init__()
        self.lm, self.blind = lm, _DropPositions(lm.get_decoder())
        self.config = lm.config

    def get_decoder(self):
        return self.blind

    def get_output_embeddings(self):
        return self.lm.get_output_embeddings()

    def forward(self, position_ids=None, **kwargs):
        return self.lm(**kwargs)


@pytest.mark.parametrize("route", ["chunked", "full-logits"])
def test_a_model_that_ignores_position_ids_is_refused_in_one_line(route):
    blind = PositionBlindLM(spread_llama(seed=41))
    model = blind if route == "chunked" else NoSplit(blind)
    seqs = random_seqs(64, seed=42)
    token_logps(model, seqs)  # padded: fine
    with pytest.raises(UserError) as e:
        check_packing(model, seqs)
    msg = str(e.value)
    assert "\n" not in msg
    name = "PositionBlindLM" if route == "chunked" else "NoSplit"
    assert msg == f"{name} does not support packed sequences (position ids restarting per sequence): " \
                  f"set train.packing=false"
    with pytest.raises(UserError):  # the fixed probe of a run's setup step finds it too
        check_packing(model, packing_probe(model, "cpu"))
    check_packing(spread_llama(seed=41), packing_probe(model, "cpu"))  # a model that packs passes


def test_the_check_runs_in_eval_mode_and_restores_training_flags():
    """Dropout would make packed and padded differ at random: the check runs without it."""
    model = tiny_llama(43, attention_dropout=0.5).train()
    check_packing(model, random_seqs(64, seed=44))  # would raise if the check ran with dropout
    assert all(m.training for m in model.modules())


# ------------------------------------------------------------------ (f) a real run, packed vs padded
def test_a_real_run_with_packing_logs_the_same_losses(cache_dir, tmp_path):
    """job.run_rank (what `humanline train` runs per job) on the bundled world, in this process: 3 steps of
    each objective with humanline on, packed vs padded (length-bucketed, 2 micro-batches per step), in
    float64: the two differ only in rounding, so losses and gradient norms agree to 1e-9 (numerics.py)
    on any CPU kernel set."""
    for objective in ("dpo", "kto", "grpo"):
        rows = {}
        for packing in (False, True):
            overrides = [*TINY_WORLD, *FAST, "backend=cpu", *FP64, *PADDED, f"objective={objective}",
                         "+humanline=true", "train.micro_batch_size=4", "judge=none", "train.save_model=false",
                         f"train.packing={str(packing).lower()}"]
            rows[packing] = run_in_process(tmp_path / f"{objective}-packing-{packing}", tmp_path, overrides)
        assert [r["step"] for r in rows[True]] == [r["step"] for r in rows[False]] == [1, 2, 3]
        assert_same_rows(rows[False], rows[True], what=objective)  # float64: relative 1e-9 (numerics.py)
        for a, b in zip(rows[False], rows[True]):
            assert b["tokens_per_position"] == 1.0 and 0.0 < a["tokens_per_position"] < 1.0
        assert len({r["loss"] for r in rows[False]}) > 1  # the runs really moved
        print(f"\n{objective}: losses {[round(r['loss'], 6) for r in rows[True]]}, tokens_per_position padded "
              f"{[round(r['tokens_per_position'], 3) for r in rows[False]]}, packed 1.0")
