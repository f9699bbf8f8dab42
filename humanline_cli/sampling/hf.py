"""transformers sampler: batched, left-padded decoding with the KV cache; returns ids, text and log-probs.

It samples from the live policy module, so pushing weights is free (a no-op). The decoding loop is our
own (not `generate`) for two reasons:
- memory: each step keeps only the chosen token's raw log-prob, a (B,) tensor; `generate(output_logits=
  True)` kept (B, V) fp32 logits for every step, B x T x V in all (74 GiB for 128 prompts x 1,024 tokens
  at a 152k vocabulary);
- seeds: completion j of prompt i draws its uniforms from its own generator seeded with
  sample_seed(seed, i, j), so a completion does not depend on which prompts share its batch, call or
  rank (sharded sampling under DDP/FSDP gives the one-process round exactly).
"""
from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable

import torch

from humanline_cli.core.interfaces import Completions, SamplingParams
from humanline_cli.sampling.sampler import cut_at_eos, sample_seed


class HFSampler:
    """`lockstep` (FSDP: every forward is a collective): a function int -> the max of that int over
    ranks; with it every rank runs the same number of batches and decoding steps (a rank with nothing
    left decodes a dummy row and drops it). An FSDP2 model is gathered once per generate call (`gathered`),
    not once per layer per decoded token."""

    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256, autocast=None,
                 lockstep: Callable[[int], int] | None = None):
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.autocast = autocast
        self.lockstep = lockstep

    def push_weights(self, policy) -> None:
        self.model = policy

    def sleep(self) -> None:
        pass  # samples from the live policy: nothing to free

    def close(self) -> None:
        pass

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams,
                 indices: list[int] | None = None) -> Completions:
        indices = list(range(len(prompt_ids))) if indices is None else list(indices)
        # one row per completion, prompt-major: row i * n + j is sample j of prompt i
        rows = [(p, sample_seed(params.seed, idx, j)) for p, idx in zip(prompt_ids, indices) for j in range(params.n)]
        per_call = max(1, self.batch_size)
        calls = -(-len(rows) // per_call)
        if self.lockstep is not None:
            calls = self.lockstep(calls)
        was_training = self.model.training
        self.model.eval()
        ids_out, logps_out = [], []
        try:
            with gathered(self.model):
                for c in range(calls):
                    chunk = rows[c * per_call:(c + 1) * per_call]
                    dummy = not chunk
                    if dummy:  # lockstep: this rank has run out of rows; decode one row and drop it
                        chunk = [([self.tok.pad_token_id], 0)]
                    ids, lps = self._generate_batch([p for p, _ in chunk], [s for _, s in chunk], params)
                    if not dummy:
                        ids_out += ids
                        logps_out += lps
        finally:
            self.model.train(was_training)
        texts = self.tok.batch_decode(ids_out, skip_special_tokens=True)
        return Completions(params.n, ids_out, logps_out, texts)

    def _forward(self, ids, attention, positions, past):
        kwargs = dict(input_ids=ids, attention_mask=attention, position_ids=positions, past_key_values=past,
                      use_cache=True)
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model  # peft
        # the prefill's (B, prompt length, V) logits are never needed: only the last position's
        if "logits_to_keep" in inspect.signature(base.forward).parameters:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        logits = out.logits[:, -1, :]
        return logits.to(torch.promote_types(logits.dtype, torch.float32)), out.past_key_values  # bf16 -> fp32

    def _generate_batch(self, prompts: list[list[int]], seeds: list[int], params: SamplingParams):
        """Rows of prompts -> (ids, raw log-probs) per row.

        Per step: logits (B, V) of the last position; log-probs log_softmax(logits) (raw), or
        log_softmax(logits / T) with params.tempered_logps (not greedy);
        the next token is the argmax (greedy) or the inverse-CDF draw from softmax(logits / T) restricted
        to the top-p nucleus, with the row's own uniform for that step. Only the chosen token's log-prob
        is kept, (B,) per step."""
        device = next(self.model.parameters()).device
        pad, eos = self.tok.pad_token_id, self.tok.eos_token_id
        B, T = len(prompts), params.max_new_tokens
        width = max(len(p) for p in prompts)
        input_ids = torch.full((B, width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding so every prompt ends where generation starts
            input_ids[i, width - len(p):] = torch.tensor(p)
            attention[i, width - len(p):] = 1
        input_ids, attention = input_ids.to(device), attention.to(device)
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        greedy = params.temperature == 0
        tempered = params.tempered_logps and not greedy
        uniforms = None
        if not greedy:  # (B, T) uniforms, each row from its own generator (CPU: the same on every device)
            uniforms = torch.stack([torch.rand(T, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
                                    for s in seeds]).to(device)
        tokens, logps = [], []
        done = torch.zeros(B, dtype=torch.bool, device=device)
        ctx = self.autocast() if self.autocast else torch.autocast("cpu", enabled=False)
        past, step_ids = None, input_ids
        with ctx:
            for t in range(T):
                logits, past = self._forward(step_ids, attention, positions, past)
                raw = torch.log_softmax(logits / params.temperature if tempered else logits, dim=-1)
                nxt = logits.argmax(-1) if greedy else _draw(logits, params, uniforms[:, t])
                nxt = torch.where(done, torch.full_like(nxt, pad), nxt)
                tokens.append(nxt)
                logps.append(raw.gather(-1, nxt.unsqueeze(-1)).squeeze(-1))
                if eos is not None:
                    done = done | (nxt == eos)
                active = int(not bool(done.all())) if t + 1 < T else 0
                if self.lockstep is not None:
                    active = self.lockstep(active)
                if not active:
                    break
                step_ids = nxt.unsqueeze(-1)
                attention = torch.cat([attention, torch.ones_like(attention[:, :1])], dim=-1)
                positions = positions[:, -1:] + 1
        new = torch.stack(tokens, dim=1).cpu()
        lp = torch.stack(logps, dim=1).cpu()
        ids, lps = [], []
        for row, lrow in zip(new.tolist(), lp.tolist()):
            kept = cut_at_eos(row, eos)
            ids.append(kept)
            lps.append(lrow[: len(kept)])
        return ids, lps


@contextlib.contextmanager
def gathered(model: torch.nn.Module):
    """An FSDP2 model's parameters all-gathered once (every rank enters: the gathers are collectives) and kept
    whole until the block ends, then resharded; forwards inside gather nothing. Decoding otherwise re-gathers
    every layer for every token: at 8B on 8 ranks, 16 GB of bf16 weights per token, minutes per evaluation
    point. The whole model (in the compute dtype) is alive meanwhile, beside the training state. Training's
    setting is restored after: decoder layers reshard after forward, the root (FSDP2's own default) does not."""
    from torch.distributed.fsdp import FSDPModule

    shards = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not shards:
        yield
        return
    root = shards[0]
    root.set_reshard_after_forward(False)
    try:
        for m in shards:
            m.unshard()
        yield
    finally:
        for m in shards:
            m.reshard()
        root.set_reshard_after_forward(True)
        root.set_reshard_after_forward(False, recurse=False)


def _draw(logits: torch.Tensor, params: SamplingParams, u: torch.Tensor) -> torch.Tensor:
    """(B, V) logits, (B,) uniforms in [0, 1) -> (B,) token ids drawn from softmax(logits / T) cut to the
    smallest set of most likely tokens whose probability reaches top_p (always at least the top token)."""
    probs = torch.softmax(logits / params.temperature, dim=-1).double()
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        sorted_p = sorted_p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
    cdf = probs.cumsum(-1)
    target = (u * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=logits.shape[-1] - 1)
