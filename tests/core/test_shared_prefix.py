"""train.shared_prefix: rows that share a prompt run it once, and token_logps gives the padded batch's values and
gradients (float64, relative 1e-10), for groups of different prompt and completion lengths, DPO-shaped pairs,
LoRA and the reference's no-grad forward; the plan is what the layout says, and it declines where nothing repeats."""
from __future__ import annotations

import pytest
import torch

from humanline_cli.core import shared_prefix
from humanline_cli.core.logprobs import PLAIN, ForwardOptions, processed_tokens, token_logps
from humanline_cli.data.collate import make_seqs
from tests.helpers.models import spread_llama
from tests.helpers.numerics import assert_same, close, values_and_grads

pytestmark = pytest.mark.usefixtures("one_thread", "norm_in_input_dtype")  # conftest: torch on one thread

SHARE = ForwardOptions(share_prefix=True)  # train.shared_prefix, as the builder gives it to the policy and reference


def logps_with(options: ForwardOptions, **kw):
    return lambda model, seqs: token_logps(model, seqs, options, **kw)


@pytest.fixture
def norm_in_input_dtype(monkeypatch):
    """transformers' LlamaRMSNorm computes in float32 whatever the input's dtype, so its backward rounds each
    gradient to float32. The shared path sums a prompt's gradients over its rows before that rounding, the padded
    path after it: the two differ by float32 rounding (about 1e-8 of the largest gradient) for a float64 model.
    The same norm in the input's dtype keeps the comparison in float64, where the two agree to 1e-10."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(LlamaRMSNorm, "forward", forward)


def grouped_seqs():
    """Two prompts (12 and 9 tokens), three and two samples each, completions of 1 to 6 tokens, rows interleaved."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 64, (12,), generator=g).tolist(), torch.randint(1, 64, (9,), generator=g).tolist()]
    owner = [0, 1, 0, 0, 1]
    lengths = [4, 6, 1, 3, 2]
    completions = [torch.randint(1, 64, (k,), generator=g).tolist() for k in lengths]
    return make_seqs([prompts[o] for o in owner], completions, pad_id=0)


@pytest.fixture(params=["packed", "packed_eager", "two_calls"])
def layout(request, monkeypatch):
    """Each way the shared layout runs (module docstring of core/shared_prefix.py): packed rows under sdpa and under
    eager attention (a boolean and an additive mask), and the two-call layout an accelerator runs (forced here)."""
    if request.param == "two_calls":
        monkeypatch.setattr(shared_prefix, "packs", lambda decoder, device: False)
    if request.param == "packed_eager":
        # transformers' eager attention takes its softmax in float32 whatever the input's dtype, and rows of the
        # packed and padded layouts differ in length, so in float32 they round differently (about 3e-7); the
        # softmax in the input's dtype keeps the comparison in float64, like the norm fixture above
        softmax = torch.nn.functional.softmax
        monkeypatch.setattr(torch.nn.functional, "softmax", lambda x, dim=None, dtype=None, **kw: softmax(x, dim=dim))
    return request.param


def model_for(layout: str, **kw):
    model = spread_llama(**kw)
    if layout == "packed_eager":
        model.config._attn_implementation = "eager"  # the decoder shares the config
    return model


def test_the_plan_runs_each_prompt_once():
    seqs = grouped_seqs()
    plan = shared_prefix.plan(seqs, packed=False)
    # prefixes are the prompts (12 and 9 tokens: the rows of a prompt differ from their first completion token on)
    assert plan.group.tolist() == [0, 1, 0, 0, 1]
    assert plan.start.tolist() == [12, 9, 12, 12, 9]
    assert plan.prefix_ids.shape == (2, 12) and plan.prefix_mask.tolist() == [[1] * 12, [1] * 9 + [0] * 3]
    assert torch.equal(plan.prefix_ids[0], seqs.input_ids[0, :12]) and torch.equal(plan.prefix_ids[1, :9],
                                                                                    seqs.input_ids[1, :9])
    # suffixes: the completions, 4, 6, 1, 3, 2 tokens (the 1-token row's loss position, its prompt's last, is in
    # the prefix); two calls: 2 x 12 prefix + 5 x 6 suffix positions, against 5 x 16 padded
    assert plan.suffix_mask.sum(1).tolist() == [4, 6, 1, 3, 2] and plan.suffix_ids.shape == (5, 6)
    assert torch.equal(plan.suffix_ids[1], seqs.input_ids[1, 9:15])
    assert plan.tree is None and plan.positions() == 54 and seqs.input_ids.shape == (5, 16)
    assert processed_tokens(spread_llama(), seqs, PLAIN) == 80


def test_the_packed_plan_puts_each_prompt_and_its_suffixes_in_one_row():
    seqs = grouped_seqs()
    tree = shared_prefix.plan(seqs, packed=True).tree
    # prompt 0 (rows 0, 2, 3): 12 + 4 + 1 + 3 = 20 tokens; prompt 1 (rows 1, 4): 9 + 6 + 2 = 17, padded to 20
    assert tree.ids.shape == (2, 20) and tree.at.tolist() == [12, 9, 16, 17, 15]
    assert tree.positions[0].tolist() == [*range(12), 12, 13, 14, 15, 12, 12, 13, 14]
    assert tree.positions[1].tolist() == [*range(9), *range(9, 15), 9, 10, 0, 0, 0]
    assert torch.equal(tree.ids[0, :12], seqs.input_ids[0, :12]) and torch.equal(tree.ids[0, 17:], seqs.input_ids[3, 12:15])
    assert torch.equal(tree.ids[1, 15:17], seqs.input_ids[4, 9:11]) and tree.ids[1, 17:].tolist() == [0, 0, 0]
    # row 2's token (packed column 16) sees the prompt and itself, not row 0's suffix; row 3's last sees its own
    assert tree.allowed[0, 16].tolist() == [True] * 12 + [False] * 4 + [True] + [False] * 3
    assert tree.allowed[0, 19].tolist() == [True] * 12 + [False] * 5 + [True] * 3
    # a padding query sees the prompt only; no query sees padding
    assert tree.allowed[1, 18].tolist() == [True] * 9 + [False] * 11 and not tree.allowed[1, :, 17:].any()
    assert shared_prefix.plan(seqs, packed=True).positions() == 40
    assert processed_tokens(spread_llama(), seqs, SHARE) == 40  # a CPU with sdpa attention: packed


def test_a_packed_mask_over_the_limit_runs_two_calls(monkeypatch):
    monkeypatch.setattr(shared_prefix, "TREE_MASK_LIMIT", 2 * 20 * 20 - 1)
    assert shared_prefix.plan(grouped_seqs(), packed=True).tree is None


def common_start_pairs():
    """DPO-shaped pairs whose chosen and rejected begin alike: pair 0 agrees on 3 completion tokens, pair 1's
    rejected is its chosen's first 2 tokens (the prefix then stops one short of the shorter row's end)."""
    prompts = [list(range(3, 15)), list(range(15, 25))]
    chosen = [[30, 31, 32, 40, 41], [33, 34, 35]]
    rejected = [[30, 31, 32, 50], [33, 34]]
    return make_seqs(prompts + prompts, chosen + rejected, pad_id=0)


def test_pairs_that_begin_alike_share_their_common_tokens(layout):
    seqs = common_start_pairs()
    plan = shared_prefix.plan(seqs, packed=False)
    # pair 0: 12 prompt + 3 common tokens; pair 1: 10 + 2 tokens less the shorter row's last
    assert plan.group.tolist() == [0, 1, 0, 1] and plan.start.tolist() == [15, 11, 15, 11]
    assert plan.suffix_mask.sum(1).tolist() == [2, 2, 1, 1]
    assert plan.positions() == 2 * 15 + 4 * 2
    assert shared_prefix.plan(seqs, packed=True).positions() == 2 * (15 + 2 + 1)
    model = model_for(layout, dtype=torch.float64)
    shared = values_and_grads(logps_with(SHARE), model, seqs)
    assert_same(shared, values_and_grads(logps_with(PLAIN), model, seqs))
    logps, _ = shared
    assert int((logps != 0).sum()) == 5 + 3 + 4 + 2  # one log-prob per completion token, the common ones per row
    assert torch.equal(logps[0, 11:14], logps[2, 11:14])  # the common tokens' log-probs: one state, both rows


def test_no_repeated_prompt_no_plan():
    seqs = make_seqs([[1, 2, 3], [4, 5, 6]], [[7, 8], [9]], pad_id=0)
    assert shared_prefix.plan(seqs, packed=True) is None
    # a row without a completion token: the padded path
    seqs = make_seqs([[1, 2, 3], [1, 2, 3]], [[7, 8], []], pad_id=0)
    assert shared_prefix.plan(seqs, packed=True) is None


def test_a_share_that_does_not_pay_runs_padded():
    # a 2-token prompt shared by rows with long completions. The two calls need a quarter of the padded positions
    # saved: 2 x 2 + 2 x 8 = 20 > 0.75 x 2 x 10 = 15. The packed row is one call, like the padded batch: 5% saved
    # is enough, 2 + 8 + 8 = 18 <= 0.95 x 20
    seqs = make_seqs([[5, 6], [5, 6]], [list(range(1, 9)), list(range(11, 19))], pad_id=0)
    assert shared_prefix.plan(seqs, packed=False) is None and shared_prefix.plan(seqs, packed=True).positions() == 18
    # completions of 19 tokens: 2 + 19 + 19 = 40 > 0.95 x 2 x 21 = 39.9
    seqs = make_seqs([[5, 6], [5, 6]], [list(range(1, 20)), list(range(21, 40))], pad_id=0)
    assert shared_prefix.plan(seqs, packed=True) is None


@pytest.mark.parametrize("tie", [False, True])
def test_shared_matches_padded_values_and_gradients(tie, layout):
    model = model_for(layout, tie=tie, dtype=torch.float64)
    shared = values_and_grads(logps_with(SHARE, chunk_size=3), model, grouped_seqs())
    padded = values_and_grads(logps_with(PLAIN, chunk_size=3), model, grouped_seqs())
    assert_same(shared, padded)
    logps, _ = shared
    assert int((logps != 0).sum()) == 4 + 6 + 1 + 3 + 2  # one log-prob per completion token


def test_pairs_and_no_grad(layout):
    """DPO's layout: B chosen then B rejected, each pair on one prompt; the reference's forward runs no-grad."""
    model = model_for(layout, dtype=torch.float64)
    prompts = [list(range(3, 15)), list(range(15, 25))]
    seqs = make_seqs(prompts + prompts, [[20, 21, 22], [23], [24, 25], [26, 27, 28, 29]], pad_id=0)
    assert shared_prefix.plan(seqs, packed=True).group.tolist() == [0, 1, 0, 1]
    with torch.no_grad():
        a = token_logps(model, seqs, SHARE)
        b = token_logps(model, seqs)
    assert not a.requires_grad and close(a, b)
    assert_same(values_and_grads(logps_with(SHARE), model, seqs), values_and_grads(logps_with(PLAIN), model, seqs))


def test_lora_model_matches_padded(layout):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model_for(layout, dtype=torch.float64),
                           LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    assert_same(values_and_grads(logps_with(SHARE), model, grouped_seqs()),
                values_and_grads(logps_with(PLAIN), model, grouped_seqs()))


def test_gradient_checkpointing_runs_padded():
    model = spread_llama(dtype=torch.float64)
    model.gradient_checkpointing_enable()
    model.train()
    seqs = grouped_seqs()
    assert processed_tokens(model, seqs, SHARE) == seqs.input_ids.numel()
    model.gradient_checkpointing_disable()


def test_a_real_run_with_shared_prefixes_logs_the_same_losses(cache_dir, tmp_path):
    """job.run_rank (what `humanline train` runs per job) on the bundled world, in this process: 2 steps of GRPO
    (groups of samples of one prompt; DPO's pairs are the unit test above) with humanline on, shared vs padded,
    in float64 with the norm in float64 (the fixture): losses and gradient norms agree to 1e-9 (numerics.py), and
    the shared run's forwards cover fewer positions than the tokens they score."""
    from tests.helpers.cli import FAST, TINY_WORLD, run_in_process
    from tests.helpers.numerics import FP64, assert_same_rows

    objective = "grpo"
    fast = [o for o in FAST if not o.startswith("train.steps=")]
    rows = {shared: run_in_process(tmp_path / f"{objective}-shared-{shared}", tmp_path,
                                   [*TINY_WORLD, *fast, "train.steps=2", "backend=cpu", *FP64, f"objective={objective}",
                                    "+humanline=true", "train.micro_batch_size=4", "judge=none",
                                    "train.save_model=false", f"train.shared_prefix={str(shared).lower()}"])
            for shared in (False, True)}
    assert [r["step"] for r in rows[True]] == [r["step"] for r in rows[False]] == [1, 2]
    assert_same_rows(rows[False], rows[True], what=objective)  # float64: relative 1e-9 (numerics.py)
    assert len({r["loss"] for r in rows[False]}) > 1  # the runs really moved
    for a, b in zip(rows[False], rows[True]):  # real tokens per decoder position
        assert a["tokens_per_position"] < 1.0 < b["tokens_per_position"], (objective, a, b)


def test_packing_takes_precedence():
    """train.packing runs its own padding-free layout: a packed batch never takes the shared path."""
    seqs = grouped_seqs()
    both = ForwardOptions(pack=True, share_prefix=True)
    assert processed_tokens(spread_llama(), seqs, both) == int(seqs.attention_mask.sum())


def test_a_decoder_that_takes_no_cache_runs_padded():
    """A model's own decoder whose forward takes no past_key_values: the padded batch, the same log-probs."""
    model = spread_llama(dtype=torch.float64)
    inner = model.model

    class NoCache(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids, attention_mask=None, use_cache=False):
            return self.inner(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)

    seqs = grouped_seqs()
    with torch.no_grad():
        expected = token_logps(model, seqs, PLAIN)
        model.get_decoder = lambda: NoCache()
        assert shared_prefix.hidden_at(None, model.get_decoder(), shared_prefix.plan(seqs, packed=True), None,
                                        None) is None
        assert close(token_logps(model, seqs, SHARE), expected)
    assert processed_tokens(model, seqs, SHARE) == seqs.input_ids.numel()  # the padded batch's positions
