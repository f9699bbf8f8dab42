"""The LM head and log-softmax in float32 under bf16 compute (CPU autocast; CUDA autocast runs the same code; FSDP2
mixed precision on 2 gloo ranks): at a reference sync every log-ratio is exactly 0, and a small weight change moves
the log-ratios smoothly (as the float64 log-softmax of the float32 logits predicts), not in bf16 steps.

The change is the final norm's weight scaled by (1 + d): it scales every logit by (1 + d), so the log-ratio of token
t is exactly logsoftmax((1 + d) z)[t] - logsoftmax(z)[t] ~ d (z_t - E_p z), about 1e-3 here. bf16 logits (steps of
2^-7 relative: 0.02-0.1 nats for these logits of 3-15) or bf16 head inputs (a 1e-3 change is below half a bf16 step,
2^-9) break that by far more than the float32 rounding of the log-probs (~1e-6)."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as tdist
import torch.multiprocessing as mp

from humanline_cli.core.logprobs import completion_mask, token_logps
from humanline_cli.core.reference import FrozenCopy, build_reference
from tests.helpers.models import spread_llama
from tests.helpers.numerics import random_seqs

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread

STEPS = (1e-3, 2e-3, 3e-3)
FSDP_STEPS = (2e-4, 4e-4, 6e-4)  # d, 2d, 3d
# float32 log-probs of ~64 terms of size up to ~15 (a few ulps of 16: 1e-6 each), two of them per log-ratio; the
# bf16 error this test exists to catch is 1e-2
TOL = 2e-5


def _scale_norm(model: torch.nn.Module, base: torch.Tensor, d: float) -> None:
    with torch.no_grad():
        model.get_decoder().norm.weight.copy_(base * (1 + d))


def _exact_logratio(model: torch.nn.Module, seqs, d: float) -> torch.Tensor:
    """float64 logsoftmax((1 + d) z)[t] - logsoftmax(z)[t], z the model's float32 logits at d = 0 (under the same
    autocast, so the decoder's hidden states are the ones token_logps sees)."""
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = model.get_decoder()(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).last_hidden_state
    z = torch.nn.functional.linear(hidden.float(), model.get_output_embeddings().weight).double()[:, :-1]
    targets = seqs.input_ids[:, 1:, None]
    lp = lambda x: torch.log_softmax(x, -1).gather(-1, targets).squeeze(-1)  # noqa: E731
    return (lp((1 + d) * z) - lp(z)) * completion_mask(seqs).double()


def test_bf16_autocast_logratios_are_zero_at_a_sync_and_move_smoothly():
    policy = spread_llama(seed=3).eval()
    seqs = random_seqs(64, seed=4)
    reference = FrozenCopy(policy)
    base = policy.get_decoder().norm.weight.detach().clone()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        at_sync = token_logps(policy, seqs, chunk_size=5) - reference.logps(seqs)
    # zero up to float32 rounding (TOL): the chunked and the whole-batch head may block the GEMM differently on some
    # CPUs (AMD EPYC), so exact zero is not promised; bf16 logits would be off by 1e-2
    assert at_sync.dtype == torch.float32 and float(at_sync.abs().max()) < TOL
    mask = completion_mask(seqs).bool()
    for d in STEPS:
        _scale_norm(policy, base, d)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            got = token_logps(policy, seqs, chunk_size=5) - reference.logps(seqs)
        want = _exact_logratio(reference.model, seqs, d)
        assert float(want[mask].abs().max()) > 20 * TOL  # a real move: ~d * (z_t - E z)
        assert float((got.double() - want)[mask].abs().max()) < TOL, d
    reference.sync(policy)  # the sync: the reference takes the moved weights, every log-ratio is 0 again
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert float((token_logps(policy, seqs) - reference.logps(seqs)).abs().max()) < TOL


def _fsdp_rank(rank: int, store: str, out: str) -> None:
    """FSDP2 bf16 mixed precision as a run builds it: the policy's layers gathered in bf16, the root (norm, head)
    in fp32; the reference a bf16-layer copy under the same policies. Log-ratios at d = 0 and at each step."""
    from humanline_cli.backend import cast_layers, shard_model

    tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        policy = spread_llama(seed=3).eval()
        reference = build_reference(policy, lora=False, moving=True, cache=False,
                                    shard=lambda m: shard_model(m, torch.bfloat16),
                                    cast=lambda m: cast_layers(m, torch.bfloat16))
        shard_model(policy, torch.bfloat16)
        seqs = random_seqs(64, seed=4)
        norm = policy.get_decoder().norm.weight
        base = norm.detach().clone()  # this rank's shard (a DTensor)
        rows = []
        for d in (0.0, *FSDP_STEPS):
            policy.reshard()  # an FSDP2 root stays gathered after a forward: back to shards, as an optimizer step
            with torch.no_grad():
                norm.copy_(base * (1 + d))
                rows.append(token_logps(policy, seqs, chunk_size=5) - reference.logps(seqs))
        reference.sync(policy)
        with torch.no_grad():
            rows.append(token_logps(policy, seqs, chunk_size=5) - reference.logps(seqs))
        if rank == 0:
            torch.save(rows, out)
        tdist.barrier()
    finally:
        tdist.destroy_process_group()


def test_fsdp2_bf16_logratios_are_zero_at_a_sync_and_move_smoothly(tmp_path):
    """Under FSDP2 the hidden states come from bf16 layers, so the exact value is not the one-process one; the
    log-ratio's smoothness is: at d, 2d, 3d it is k times the first up to (k^2 - k) d^2 Var(z) / 2 (< 4e-6 here,
    Var(z) < 30) and float32 rounding, while bf16 logits jump by 1e-2."""
    out = str(tmp_path / "rows.pt")
    mp.spawn(_fsdp_rank, args=(str(tmp_path / "store"), out), nprocs=2, join=True)
    rows = torch.load(out)
    mask = completion_mask(random_seqs(64, seed=4)).bool()
    # at the start and after the sync: zero up to float32 rounding (TOL, as in the one-process test)
    assert float(rows[0].abs().max()) < TOL and float(rows[-1].abs().max()) < TOL
    first = rows[1][mask].double()
    assert float(first.abs().max()) > 20 * TOL
    for k, row in enumerate(rows[1:4], start=1):  # d, 2d, 3d: k times the first step's log-ratio
        assert float((row[mask].double() - k * first).abs().max()) < TOL, k


def test_a_frozen_bf16_head_still_runs():
    """A 16-bit head (a LoRA run's frozen bf16 base under autocast) runs as it is: bf16 logits, float32 log-probs."""
    model = copy.deepcopy(spread_llama(seed=3)).to(torch.bfloat16).eval()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_logps(model, random_seqs(64, seed=4))
    assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
