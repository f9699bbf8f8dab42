"""LoRA policies (lora.py) and the two LoRA references (reference.py) on tiny Llamas built here.

Model: vocab 32, hidden 64, 2 layers, 2 heads of head_dim 32 (2 kv heads), MLP 128. With
target_modules="all-linear" and r=4, per layer: q/k/v/o are 64->64, so A (4x64) + B (64x4) = 512
each, 2048 for the four; gate/up are 64->128: 4*64 + 128*4 = 768 each; down is 128->64:
4*128 + 64*4 = 768; 2048 + 3*768 = 4352 per layer, 8704 for the two (lm_head is not a target).
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from humanline_cli.core.batches import Seqs
from humanline_cli.core.logprobs import completion_mask, token_logps
from humanline_cli.core.lora import (
    POLICY_ADAPTER,
    REFERENCE_ADAPTER,
    adapter_tensors,
    apply_lora,
    merged_state_dict,
    save_merged,
)
from humanline_cli.core.losses import dpo_loss
from humanline_cli.core.reference import AdapterReference, BaseReference, make_lora_reference
from tests.helpers.models import lora_base_llama, lora_llama

ADAPTER_PARAMS = 2 * (4 * (4 * 64 + 64 * 4) + 2 * (4 * 64 + 128 * 4) + (4 * 128 + 64 * 4))  # 8704
LN2 = math.log(2.0)


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


def pair_seqs(seed: int = 1) -> Seqs:
    """2 pairs: rows 0-1 chosen, rows 2-3 rejected; prompt = first 4 tokens, right padding on rows 1 and 3."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (4, 10), generator=g)
    attn = torch.ones(4, 10, dtype=torch.long)
    attn[1, 8:] = 0
    attn[3, 7:] = 0
    loss = attn.bool().clone()
    loss[:, :4] = False
    return Seqs(input_ids=ids, attention_mask=attn, loss_mask=loss)


def dpo_step_loss(policy, reference, seqs: Seqs) -> torch.Tensor:
    mask = completion_mask(seqs)
    logratio = token_logps(policy, seqs) - reference.logps(seqs)
    loss, _ = dpo_loss(logratio[:2], mask[:2], logratio[2:], mask[2:], beta=0.1)
    return loss


def base_weights(peft_model) -> dict[str, torch.Tensor]:
    """Every non-adapter tensor of the wrapped model, under the plain model's names, cloned."""
    sd = peft_model.get_base_model().state_dict()
    return {k.replace(".base_layer.", "."): v.detach().clone() for k, v in sd.items() if ".lora_" not in k}


def snapshot(peft_model, adapter: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in adapter_tensors(peft_model, adapter).items()}


def randomize_adapter(peft_model, seed: int = 5, adapter: str = POLICY_ADAPTER) -> None:
    """Give lora_B (zero at init, so the adapter is a no-op) nonzero values."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, p in adapter_tensors(peft_model, adapter).items():
            if ".lora_B." in key:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


# ------------------------------------------------------------------ lora.apply_lora: only adapters train
def test_training_changes_only_adapter_weights():
    plain = lora_base_llama()
    before = {k: v.detach().clone() for k, v in plain.state_dict().items()}
    policy = apply_lora(plain, r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    reference = BaseReference(policy)
    adapter_before = snapshot(policy, POLICY_ADAPTER)
    assert sum(p.numel() for p in trainable(policy)) == ADAPTER_PARAMS
    opt = torch.optim.AdamW(trainable(policy), lr=1e-2, weight_decay=0.0)
    seqs = pair_seqs()
    losses = []
    for _ in range(4):
        loss = dpo_step_loss(policy, reference, seqs)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        opt.step()
    # lora_B starts at 0, so the policy starts equal to its base: log-ratios 0, loss ln 2
    assert abs(losses[0] - LN2) < 1e-6
    assert losses[-1] < losses[0] - 1e-4  # and training moved it
    after = base_weights(policy)
    assert after.keys() == before.keys()
    for key, value in before.items():
        assert torch.equal(after[key], value), key  # bit-identical
    adapter_after = snapshot(policy, POLICY_ADAPTER)
    changed = {k for k in adapter_before if not torch.equal(adapter_before[k], adapter_after[k])}
    assert any(".lora_A." in k for k in changed) and any(".lora_B." in k for k in changed)


def test_apply_lora_takes_a_list_of_target_modules_and_rejects_rank_0():
    policy = apply_lora(lora_base_llama(), r=2, alpha=4.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    # q and v are 64->64: A (2x64) + B (64x2) = 256 each, 2 modules x 2 layers
    assert sum(p.numel() for p in trainable(policy)) == 2 * 2 * (2 * 64 + 64 * 2)
    with pytest.raises(ValueError, match="r=0"):
        apply_lora(lora_base_llama(), r=0, alpha=8.0, dropout=0.0, target_modules="all-linear")


# ------------------------------------------------------------------ BaseReference
def test_base_reference_is_the_plain_starting_model():
    policy = lora_llama(seed=0)
    randomize_adapter(policy)  # a trained policy: its own log-probs now differ from the base's
    plain = lora_base_llama(seed=0).eval()  # same seed, no peft
    reference = make_lora_reference(policy, moving=False)
    assert isinstance(reference, BaseReference) and reference.n_params() == 0
    seqs = pair_seqs()
    flags = [p.requires_grad for p in policy.parameters()]
    ref = reference.logps(seqs)
    expected = token_logps(plain, seqs)
    assert ref.shape == (4, 9) and ref.dtype == torch.float32
    assert torch.equal(ref, expected)  # adapters off: the base layers run the plain model's ops, bit for bit
    assert (ref[completion_mask(seqs).bool()] < 0).all()
    with torch.no_grad():
        assert (token_logps(policy, seqs) - ref).abs().max() > 1e-3  # the adapter is on again
    assert [p.requires_grad for p in policy.parameters()] == flags  # disable_adapter's flag changes undone
    assert policy.training
    with pytest.raises(RuntimeError, match="AdapterReference"):
        reference.sync(policy)


# ------------------------------------------------------------------ AdapterReference
def test_adapter_reference_starts_equal_to_the_policy():
    policy = lora_llama()
    randomize_adapter(policy)  # so "equal to the policy" is not just "both adapters are zero"
    reference = make_lora_reference(policy, moving=True)
    assert isinstance(reference, AdapterReference)
    pol, ref = snapshot(policy, POLICY_ADAPTER), snapshot(policy, REFERENCE_ADAPTER)
    assert pol.keys() == ref.keys() and len(pol) == 2 * 7 * 2  # A and B of 7 modules in 2 layers
    assert all(torch.equal(pol[k], ref[k]) for k in pol)
    seqs = pair_seqs()
    policy_logps = token_logps(policy, seqs)  # with grad, train mode (dropout 0)
    reference_logps = reference.logps(seqs)
    assert torch.equal(policy_logps.detach(), reference_logps)  # log-ratio exactly 0
    mask = completion_mask(seqs)
    logratio = policy_logps - reference_logps
    loss, _ = dpo_loss(logratio[:2], mask[:2], logratio[2:], mask[2:], beta=0.1)
    assert abs(float(loss.detach()) - LN2) < 1e-6


def test_humanline_sync_before_optimizer_step():
    """forward, backward, clip, sync, step: during step t the reference is the policy of step t-1."""
    policy = lora_llama()
    reference = AdapterReference(policy)
    opt = torch.optim.AdamW(trainable(policy), lr=1e-2, weight_decay=0.0)
    seqs = pair_seqs()
    losses = []
    for _ in range(3):
        loss = dpo_step_loss(policy, reference, seqs)
        losses.append(float(loss.detach()))
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable(policy), 1.0)
        pre_step = snapshot(policy, POLICY_ADAPTER)
        reference.sync(policy)
        opt.step()
        ref_now, pol_now = snapshot(policy, REFERENCE_ADAPTER), snapshot(policy, POLICY_ADAPTER)
        assert all(torch.equal(ref_now[k], pre_step[k]) for k in pre_step)
        assert any(not torch.equal(ref_now[k], pol_now[k]) for k in pol_now)
        assert all(not p.requires_grad for p in adapter_tensors(policy, REFERENCE_ADAPTER).values())
    assert abs(losses[0] - LN2) < 1e-6  # step 1: reference == policy
    # steps 2, 3: the reference is one step behind, so log-ratios are nonzero and the loss moves off ln 2
    assert abs(losses[1] - LN2) > 1e-5 and abs(losses[2] - LN2) > 1e-5


def test_reference_adapter_is_never_trainable_and_grads_survive_the_switch():
    policy = lora_llama()
    randomize_adapter(policy)
    reference = AdapterReference(policy)
    assert reference.n_params() == ADAPTER_PARAMS
    assert sum(p.numel() for p in trainable(policy)) == ADAPTER_PARAMS
    policy_ids = {id(p) for p in adapter_tensors(policy, POLICY_ADAPTER).values()}
    assert {id(p) for p in trainable(policy)} == policy_ids
    seqs = pair_seqs()

    # gradients of sum(policy log-probs), with and without a reference pass between forward and backward
    policy.zero_grad()
    token_logps(policy, seqs).sum().backward()
    expected = {k: p.grad.clone() for k, p in adapter_tensors(policy, POLICY_ADAPTER).items()}
    policy.zero_grad()
    total = token_logps(policy, seqs).sum()
    for _ in range(2):
        reference.logps(seqs)
    total.backward()
    for k, p in adapter_tensors(policy, POLICY_ADAPTER).items():
        assert p.grad is not None and torch.equal(p.grad, expected[k]), k
    for p in adapter_tensors(policy, REFERENCE_ADAPTER).values():
        assert not p.requires_grad and p.grad is None
    assert {id(p) for p in trainable(policy)} == policy_ids
    assert sum(p.numel() for p in trainable(policy)) == ADAPTER_PARAMS
    assert policy.active_adapter == POLICY_ADAPTER and policy.training
    with pytest.raises(ValueError, match="not the peft model"):
        reference.sync(lora_llama(seed=3))


def test_adapter_reference_ignores_lora_dropout():
    """The reference pass runs in eval mode (as FrozenCopy does): deterministic despite dropout 0.5."""
    policy = lora_llama(dropout=0.5)
    randomize_adapter(policy)
    reference = AdapterReference(policy)
    seqs = pair_seqs()
    a, b = reference.logps(seqs), reference.logps(seqs)
    assert torch.equal(a, b)
    policy.eval()
    with torch.no_grad():
        assert torch.equal(token_logps(policy, seqs), a)  # eval-mode policy == reference right after init
    policy.train()
    assert all(m.training for m in policy.modules())


# ------------------------------------------------------------------ merged weights and saving
@pytest.mark.parametrize("tie", [False, True])
def test_merged_state_dict_matches_merge_and_unload_and_save_loads_as_plain_model(tmp_path, tie):
    from humanline_cli.world.tokenizer import build_tokenizer

    policy = lora_llama(tie=tie)
    randomize_adapter(policy)
    AdapterReference(policy)  # a second adapter must not leak into the merged weights
    randomize_adapter(policy, seed=9, adapter=REFERENCE_ADAPTER)
    live_before = {k: v.detach().clone() for k, v in policy.state_dict().items()}

    merged = merged_state_dict(policy)
    expected = copy.deepcopy(policy).merge_and_unload(adapter_names=[POLICY_ADAPTER]).state_dict()
    assert merged.keys() == expected.keys()
    assert "model.layers.0.self_attn.q_proj.weight" in merged and "lm_head.weight" in merged
    assert not any("lora_" in k or "base_layer" in k for k in merged)
    for k in expected:  # both add peft's get_delta_weight to the base weight: the same ops, bit for bit
        assert torch.equal(merged[k], expected[k]), k
    # the merge really added something: q_proj differs from the base weight by B @ A * (alpha / r)
    q = policy.get_base_model().model.layers[0].self_attn.q_proj
    delta = q.lora_B[POLICY_ADAPTER].weight @ q.lora_A[POLICY_ADAPTER].weight * (8.0 / 4)
    assert delta.abs().max() > 1e-3
    assert torch.equal(merged["model.layers.0.self_attn.q_proj.weight"], q.base_layer.weight + delta)  # same formula
    # the live model is untouched
    after = policy.state_dict()
    assert after.keys() == live_before.keys() and all(torch.equal(after[k], v) for k, v in live_before.items())
    assert not q.merged

    dest = save_merged(policy, build_tokenizer(), tmp_path / "final")
    assert (dest / "model.safetensors").exists() and (dest / "tokenizer.json").exists()
    assert (dest / "adapter" / POLICY_ADAPTER / "adapter_model.safetensors").exists()
    assert not (tmp_path / "final.tmp").exists()
    loaded = AutoModelForCausalLM.from_pretrained(dest, use_safetensors=True).eval()
    assert type(loaded).__name__ == "LlamaForCausalLM" and loaded.config.tie_word_embeddings == tie
    # a tied embedding is saved once and pushed to vLLM once, as for a plain (non-LoRA) model
    from safetensors import safe_open

    from humanline_cli.sampling.vllm import policy_weights

    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        assert ("lm_head.weight" in set(f.keys())) is not tie
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) is tie
    pushed = [name for name, _ in policy_weights(policy)]
    assert pushed == [name for name, _ in policy_weights(lora_base_llama(tie=tie))]
    assert ("lm_head.weight" in pushed) is not tie
    seqs = pair_seqs()
    policy.eval()
    with torch.no_grad():
        live = policy(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
        reloaded = loaded(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    assert (live - reloaded).abs().max() < 1e-5
    assert policy.active_adapter == POLICY_ADAPTER


@pytest.mark.parametrize("moving", [False, True])
def test_reference_pass_restores_the_callers_requires_grad_flags(moving):
    """peft's adapter switches re-enable grads on the whole active adapter; a flag the caller set stays."""
    policy = lora_llama()
    reference = make_lora_reference(policy, moving=moving)
    frozen = policy.get_base_model().model.layers[0].self_attn.q_proj.lora_A[POLICY_ADAPTER].weight
    frozen.requires_grad_(False)
    flags = [p.requires_grad for p in policy.parameters()]
    reference.logps(pair_seqs())
    assert not frozen.requires_grad
    assert [p.requires_grad for p in policy.parameters()] == flags
    assert sum(p.numel() for p in trainable(policy)) == ADAPTER_PARAMS - 4 * 64


def test_a_bf16_base_pushes_an_update_below_half_its_step_to_the_sampler(tmp_path):
    """Under bf16 autocast a LoRA base loads in bf16 (peft keeps the adapters fp32). An update smaller than half a
    bf16 step of a weight rounds back to the base weight in a bf16 sum, and the sampler would sample the base model:
    the push (policy_weights, what vLLM loads) carries the merge taken in fp32, i.e. the fp64 merge rounded to fp32.

    Bound, per element: peft's delta is (B @ A) * 2 in fp32, r = 4 products summed, so off by at most
    4 * 2^-24 * 2 * (|B| @ |A|) (the scaling alpha / r = 2 is exact); the fp32 sum adds 2^-24 * |w + delta|."""
    from humanline_cli.sampling.vllm import policy_weights

    policy = apply_lora(lora_base_llama().to(torch.bfloat16), r=4, alpha=8.0, dropout=0.0, target_modules="all-linear")
    q = policy.get_base_model().model.layers[0].self_attn.q_proj
    a, b = q.lora_A[POLICY_ADAPTER].weight, q.lora_B[POLICY_ADAPTER].weight
    assert q.base_layer.weight.dtype == torch.bfloat16 and a.dtype == b.dtype == torch.float32
    with torch.no_grad():  # one small training step's worth: |delta| ~ 1e-5, against a bf16 step of ~1e-4 at |w| ~ 0.02
        b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 2e-5)
    w = q.base_layer.weight.detach().double()
    delta = (b.detach().double() @ a.detach().double()) * 2.0
    half_step = w.abs() * 2.0 ** -9  # half a bf16 step at |w| (8 bits of mantissa: a step is 2^-8 of |w| or less)
    assert (delta.abs() < half_step).float().mean() > 0.5  # most of the update: rounded away by a bf16 sum
    pushed = dict(policy_weights(policy))["model.layers.0.self_attn.q_proj.weight"]
    assert pushed.dtype == torch.float32
    bound = 2.0 ** -24 * (w + delta).abs() + 4 * 2.0 ** -24 * 2.0 * (b.detach().abs().double() @ a.detach().abs().double())
    assert ((pushed.double() - (w + delta)).abs() <= bound).all()
    assert (pushed.double() != w).float().mean() > 0.99  # the sampler gets the update, not the base
    # a weight no adapter touches goes as it is (bf16); the saved model keeps the base's dtype throughout
    assert dict(policy_weights(policy))["model.embed_tokens.weight"].dtype == torch.bfloat16
    from safetensors import safe_open

    dest = save_merged(policy, None, tmp_path / "final", save_adapter=False)
    with safe_open(str(dest / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in list(f.keys())} == {torch.bfloat16}
