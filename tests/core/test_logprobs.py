"""token_logps: the chunked LM-head path gives the full-logits values and gradients (plain Llama,
LoRA PeftModel, hooks on the head, autocast), falls back where the plain head would be wrong, and
cuts the peak memory of a forward+backward at a 128k vocabulary by more than 4x. Path-vs-path
comparisons run the model in float64 (close: relative 1e-10), so they hold on any CPU kernel set."""
from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from humanline_cli.core.logprobs import (
    LOGITS_PER_CHUNK,
    _decoder_and_head,
    _full_logits_token_logps,
    completion_mask,
    token_logps,
)
from humanline_cli.data.collate import make_seqs
from tests.helpers.models import spread_llama
from tests.helpers.numerics import assert_same, close, random_seqs, values_and_grads

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: torch on one thread


@pytest.mark.parametrize("chunk_size", [1, 7, None])
def test_chunked_matches_full_logits_values_and_gradients(chunk_size):
    model = spread_llama(dtype=torch.float64)
    seqs = random_seqs(64)
    chunked = values_and_grads(lambda m, s: token_logps(m, s, chunk_size=chunk_size), model, seqs)
    full = values_and_grads(_full_logits_token_logps, model, seqs)
    assert_same(chunked, full)
    logps, _ = chunked
    mask = completion_mask(seqs)
    assert logps.dtype == torch.float64 and logps.shape == (5, seqs.input_ids.shape[1] - 1)  # float64 kept
    assert token_logps(spread_llama(), seqs, chunk_size=chunk_size).dtype == torch.float32  # a float32 model
    assert torch.all(logps[mask == 0] == 0) and torch.all(logps[mask == 1] < 0)
    assert logps[-1].abs().sum() == 0  # the row with no completion
    # one entry by hand: log softmax of the model's own logits at that position
    i, t = (mask == 1).nonzero()[0].tolist()
    with torch.no_grad():
        logits = model(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).logits
    expected = torch.log_softmax(logits[i, t], -1)[seqs.input_ids[i, t + 1]]
    assert abs(float(logps[i, t]) - float(expected)) < 1e-12  # float64 log-softmax of ~64 terms


def test_tied_embeddings_and_no_grad():
    model = spread_llama(tie=True, dtype=torch.float64)
    seqs = random_seqs(64, seed=3)
    assert_same(values_and_grads(lambda m, s: token_logps(m, s, chunk_size=4), model, seqs),
                values_and_grads(_full_logits_token_logps, model, seqs))
    with torch.no_grad():
        a = token_logps(model, seqs, chunk_size=4)
        b = _full_logits_token_logps(model, seqs)
    assert not a.requires_grad and close(a, b)


def test_empty_completion_mask_still_backpropagates():
    model = spread_llama()
    seqs = make_seqs([[5, 6, 7], [8, 9]], [[], []], pad_id=0)
    logps = token_logps(model, seqs)
    assert logps.shape == (2, 2) and torch.all(logps == 0) and logps.requires_grad
    logps.sum().backward()  # a batch with nothing to learn must not crash the step
    assert model.get_output_embeddings().weight.grad.abs().sum() == 0


def test_head_is_called_as_a_module_so_its_hooks_fire():
    """A forward hook on lm_head (as a wrapper or adapter would install) changes the logits; the chunked
    path must see the change exactly like the model's own forward does."""
    model = spread_llama(dtype=torch.float64)
    seqs = random_seqs(64, seed=4)
    calls = []
    bias = torch.linspace(-3.0, 3.0, 64, dtype=torch.float64)

    def hook(module, args, output):
        calls.append(args[0].shape[0])
        return output + bias

    model.get_output_embeddings().register_forward_hook(hook)
    chunked = values_and_grads(lambda m, s: token_logps(m, s, chunk_size=3), model, seqs)
    n_chunked = len(calls)
    full = values_and_grads(_full_logits_token_logps, model, seqs)
    assert_same(chunked, full)
    n_tokens = int(completion_mask(seqs).sum())
    # forward chunks of <= 3 tokens, each recomputed once in the backward, then one full-path call
    assert n_chunked == 2 * -(-n_tokens // 3) and len(calls) == n_chunked + 1
    assert max(calls[:n_chunked]) == 3


def test_lora_peft_model_matches_full_path():
    import peft  # installed by `just setup` (test extra): a missing peft is a failure, not a skip
    model = spread_llama(seed=5, dtype=torch.float64)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj", "lm_head"],
                           init_lora_weights=False, lora_dropout=0.0)
    pm = peft.get_peft_model(model, lora)
    decoder, head = _decoder_and_head(pm)  # the chunked path is taken, with LoRA on the head
    assert type(head).__module__.startswith("peft") and decoder is pm.base_model.model.model
    seqs = random_seqs(64, seed=6)
    chunked = values_and_grads(lambda m, s: token_logps(m, s, chunk_size=5), pm, seqs)
    full = values_and_grads(_full_logits_token_logps, pm, seqs)
    assert_same(chunked, full)
    assert all("lora_" in k for k in chunked[1]) and any("lm_head" in k for k in chunked[1])
    with pm.disable_adapter(), torch.no_grad():  # the adapters really change the values
        base = token_logps(pm, seqs)
    assert (base - chunked[0]).abs().max() > 1e-2


def test_logit_softcapping_model_takes_the_full_path():
    """Gemma 2 soft-caps logits inside its forward; lm_head(hidden) alone would be wrong, so token_logps
    must fall back to the model's own logits."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    cfg = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                       final_logit_softcapping=2.0, pad_token_id=0)
    model = Gemma2ForCausalLM(cfg).float()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(20.0)
    seqs = random_seqs(64, seed=7)
    assert _decoder_and_head(model) is None
    with torch.no_grad():
        got = token_logps(model, seqs)
        want = _full_logits_token_logps(model, seqs)
        hidden = model.get_decoder()(input_ids=seqs.input_ids, attention_mask=seqs.attention_mask).last_hidden_state
        uncapped = torch.log_softmax(model.get_output_embeddings()(hidden)[:, :-1].float(), -1)
        uncapped = uncapped.gather(-1, seqs.input_ids[:, 1:, None]).squeeze(-1) * completion_mask(seqs)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    assert (uncapped - want).abs().max() > 0.1  # the cap matters: skipping it would change the values


def test_bf16_autocast_values_close_and_float32():
    model = spread_llama(seed=8)
    seqs = random_seqs(64, seed=9)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_logps(model, seqs, chunk_size=4)
        want = _full_logits_token_logps(model, seqs)
    assert got.dtype == torch.float32
    # both cast bf16 logits to float32; only the bf16 matmul's blocking may differ
    torch.testing.assert_close(got, want, atol=0.1, rtol=0.02)


class PeakLiveBytes(TorchDispatchMode):
    """Deterministic peak of live tensor memory (CPU or any device) during the `with` block.

    Every aten op (forward and the autograd engine's backward ops alike) passes through
    __torch_dispatch__; each output tensor whose storage is new is counted with its storage's nbytes,
    and a weakref callback on that storage subtracts it when the storage is freed (views share a
    storage and are counted once). The peak of the running sum is what the block needed on top of
    the tensors that existed before it (parameters, inputs). Scratch buffers internal to a single
    kernel are not seen; every tensor autograd keeps or a later op reads is.
    """

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict[int, weakref.ref] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t.untyped_storage())
        return out

    def _track(self, storage):
        key = id(storage)
        ref = self._seen.get(key)
        if ref is not None and ref() is storage:
            return
        nbytes = storage.nbytes()

        def freed(_, key=key, nbytes=nbytes):
            self.live -= nbytes
            self._seen.pop(key, None)

        self._seen[key] = weakref.ref(storage, freed)
        self.live += nbytes
        self.peak = max(self.peak, self.live)


def peak_bytes_of_step(fn, model, seqs) -> int:
    model.zero_grad(set_to_none=True)
    with PeakLiveBytes() as mem:
        (fn(model, seqs) * completion_mask(seqs)).sum().backward()
    return mem.peak


def test_peak_memory_at_128k_vocab_is_4x_lower():
    """One forward+backward of a tiny Llama with a 128,256-token vocabulary (Llama 3's) on 8 rows of
    up to 48 tokens (200 completion tokens) in chunks of 32 tokens: the same batch-to-chunk proportion,
    scaled down, as 8 x 1024 tokens in the default 261-token chunks. The full path holds (N, T, V)
    float32 logits, their log-sum-exp pieces and their gradient; the chunked path holds the hidden
    states and one chunk's logits. Both pay for the embedding and head weight gradients (2 x V x H)."""
    assert max(1, LOGITS_PER_CHUNK // 128_256) == 261  # the default chunk at this vocabulary
    model = spread_llama(vocab=128_256, hidden=16, layers=1)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 128_256, (16,), generator=g).tolist() for _ in range(8)]
    comps = [torch.randint(1, 128_256, (32 - 2 * i,), generator=g).tolist() for i in range(8)]
    seqs = make_seqs(prompts, comps, pad_id=0)
    before = peak_bytes_of_step(_full_logits_token_logps, model, seqs)
    after = peak_bytes_of_step(lambda m, s: token_logps(m, s, chunk_size=32), model, seqs)
    logits_bytes = 8 * 47 * 128_256 * 4
    assert before > 3 * logits_bytes  # the full path really holds several (N, T, V) float32 buffers
    assert after < 6 * 32 * 128_256 * 4 + 2 * 128_256 * 16 * 4  # a few chunk-sized buffers + weight grads
    assert before / after >= 4.0, (before, after)
    model.double()  # and the values agree at this vocabulary too (float64: see close)
    with torch.no_grad():
        assert close(token_logps(model, seqs, chunk_size=32), _full_logits_token_logps(model, seqs))
