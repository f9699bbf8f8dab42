"""The bundled world's own sampler, frozen: transformers `generate`, batched, left-padded, one torch seed per
call; returns ids, text and raw log-probs.

A world's name (`<kind>-<hash12>`, world/naming.py) stands for the data its build produces, and the
build samples the world's offline sets and base-policy metrics with this code. The training sampler
(sampling/hf.py) has since moved to its own decoding loop with per-completion seeds, which draws other
samples; keeping this copy keeps every existing world name meaning the same files. Replacing it with
sampling/hf.py is a WORLD_VERSION bump (new names, new data, the documented results re-measured).
Memory is not a concern at the world's scale (vocabularies of ~40 tokens).
"""
from __future__ import annotations

import torch

from humanline_cli.core.interfaces import Completions, SamplingParams
from humanline_cli.sampling.sampler import cut_at_eos


class FrozenWorldSampler:
    def __init__(self, model: torch.nn.Module, tokenizer, batch_size: int = 256, autocast=None):
        self.model = model
        self.tok = tokenizer
        self.batch_size = batch_size
        self.autocast = autocast

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Completions:
        torch.manual_seed(params.seed)
        was_training = self.model.training
        self.model.eval()
        per_call = max(1, self.batch_size // params.n)
        ids_out, logps_out = [], []
        try:
            for start in range(0, len(prompt_ids), per_call):
                ids, lps = self._generate_batch(prompt_ids[start : start + per_call], params)
                ids_out += ids
                logps_out += lps
        finally:
            self.model.train(was_training)
        texts = self.tok.batch_decode(ids_out, skip_special_tokens=True)
        return Completions(params.n, ids_out, logps_out, texts)

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams):
        device = next(self.model.parameters()).device
        pad = self.tok.pad_token_id
        eos = self.tok.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        attention = torch.zeros_like(input_ids)
        for i, p in enumerate(prompts):  # left padding so every prompt ends where generation starts
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        greedy = params.temperature == 0
        kwargs = dict(do_sample=False) if greedy else dict(
            do_sample=True, temperature=params.temperature, top_p=params.top_p, top_k=0)
        ctx = self.autocast() if self.autocast else torch.autocast("cpu", enabled=False)
        with ctx:
            out = self.model.generate(
                input_ids=input_ids.to(device), attention_mask=attention.to(device),
                max_new_tokens=params.max_new_tokens, num_return_sequences=params.n,
                pad_token_id=pad, eos_token_id=eos, use_cache=True,
                output_logits=True, return_dict_in_generate=True, **kwargs)
        new = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits, before temperature/top-p
        logps = torch.log_softmax(logits, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)
        ids, lps = [], []
        for row, lp in zip(new.tolist(), logps.tolist()):
            kept = cut_at_eos(row, eos)
            ids.append(kept)
            lps.append(lp[: len(kept)])
        return ids, lps
