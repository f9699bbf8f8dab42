"""The starting policy: a tiny Llama trained from scratch by SFT on a teacher.

Consumes the resolved world cfg, the tokenizer, an SFT prompt sampler and a
teacher function (prompt -> reply); produces a trained `LlamaForCausalLM`.
Also holds the small batched sampler used to measure base-policy metrics.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from humanline_cli.world.tokenizer import PLAIN_TEMPLATE

MAX_POSITIONS = 64


def new_model(mcfg: dict, tok: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=mcfg["hidden_size"],
        num_hidden_layers=mcfg["num_hidden_layers"],
        num_attention_heads=mcfg["num_attention_heads"],
        num_key_value_heads=mcfg["num_attention_heads"],
        head_dim=mcfg["head_dim"],
        intermediate_size=mcfg["intermediate_size"],
        max_position_embeddings=MAX_POSITIONS,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(config)
    _fourier_digits(model, tok)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    return model


@torch.no_grad()
def _fourier_digits(model: LlamaForCausalLM, tok: PreTrainedTokenizerFast, amplitude: float = 0.1) -> None:
    """Give digit embeddings cos/sin features of the digit value (mod 10) in
    their first dims. From a random init the ones digit of a sum (a mod-10
    lookup) sat on a ~2-nat plateau for a seed-dependent 300-1000+ steps;
    with this init SFT learns it early and reliably. Still trained from scratch."""
    emb = model.get_input_embeddings().weight
    for d in range(10):
        row = emb[tok.convert_tokens_to_ids(str(d))]
        for f in range(1, 6):
            row[2 * f - 2] = amplitude * math.cos(2 * math.pi * f * d / 10)
            row[2 * f - 1] = amplitude * math.sin(2 * math.pi * f * d / 10)


class WorldCodec:
    """Chat-format ids without the per-call overhead of apply_chat_template
    (SFT builds 256 sequences a step). Matches the template exactly; the
    tests check that."""

    def __init__(self, tok: PreTrainedTokenizerFast):
        self.vocab = tok.get_vocab()
        plain = tok.chat_template == PLAIN_TEMPLATE  # world.format=plain: no chat markers
        self.head = [tok.bos_token_id] + ([] if plain else [self.vocab["<|user|>"]])
        self.open = [] if plain else [self.vocab["<|assistant|>"]]
        self.eos, self.pad = tok.eos_token_id, tok.pad_token_id

    def prompt(self, content: str) -> list[int]:
        return self.head + [self.vocab[c] for c in content] + self.open

    def reply(self, content: str) -> list[int]:
        return [self.vocab[c] for c in content] + [self.eos]


def _batch(enc: WorldCodec, prompts: Sequence[str], replies: Sequence[str]) -> tuple[torch.Tensor, ...]:
    """Right-padded ids, attention mask and labels (-100 outside reply+EOS)."""
    rows = [(enc.prompt(p), enc.reply(r)) for p, r in zip(prompts, replies)]
    width = max(len(p) + len(r) for p, r in rows)
    # plain lists then one tensor each: per-row tensor writes cost ~20% of a step
    ids = [p + r + [enc.pad] * (width - len(p) - len(r)) for p, r in rows]
    labels = [[-100] * len(p) + r + [-100] * (width - len(p) - len(r)) for p, r in rows]
    mask = [[1] * (len(p) + len(r)) + [0] * (width - len(p) - len(r)) for p, r in rows]
    ids, mask, labels = torch.tensor(ids), torch.tensor(mask), torch.tensor(labels)
    return ids, mask, labels


def sft(
    model: LlamaForCausalLM,
    enc: WorldCodec,
    scfg: dict,
    draw: Callable[[random.Random], str],
    teacher: Callable[[random.Random, str], str],
    rng: random.Random,
    progress: bool,
    label: str = "SFT of the starting policy",
) -> list[float]:
    """Fresh teacher replies every step (so the student learns the teacher's
    distribution, not one sample of it); AdamW, linear warmup, cosine to 10%
    over `steps`. With `scfg["stop_loss"]` set, stops early once the mean loss
    of the last 50 steps is below it (the schedule is not shortened)."""
    steps, warmup = int(scfg["steps"]), int(scfg["warmup"])
    stop_loss = scfg.get("stop_loss")
    opt = torch.optim.AdamW(
        model.parameters(), lr=scfg["lr"], betas=(0.9, 0.98), weight_decay=scfg["weight_decay"]
    )

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    model.train()
    losses: list[float] = []
    with _progress(progress, label, steps) as advance:
        for _ in range(steps):
            prompts = [draw(rng) for _ in range(scfg["batch_size"])]
            ids, mask, labels = _batch(enc, prompts, [teacher(rng, p) for p in prompts])
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.size(-1)), labels[:, 1:].reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            advance(loss.item())
            if stop_loss is not None and len(losses) >= 50 and sum(losses[-50:]) / 50 < stop_loss:
                break
    model.eval()
    return losses


class _progress:
    """A rich progress bar when asked for, a no-op otherwise."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total

    def __enter__(self):
        if not self.enabled:
            return lambda loss: None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        self.bar = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]:.3f}"),
            TimeRemainingColumn(),
            transient=False,
        )
        self.bar.__enter__()
        task = self.bar.add_task(self.label, total=self.total, loss=float("nan"))
        return lambda loss: self.bar.update(task, advance=1, loss=loss)

    def __exit__(self, *exc):
        if self.enabled:
            self.bar.__exit__(*exc)
        return False
