"""Rows that share a prompt run it through the decoder once (train.shared_prefix).

A GRPO group's n samples, a DPO pair's chosen and rejected, a KTO batch's mismatched pairs: each row of such a
batch repeats its prompt, and a causal decoder's states at the prompt's positions depend on the prompt alone.
So the prompt's positions run once per distinct prompt, their keys and values (a transformers DynamicCache,
built with grad) are selected for every row that shares it, and each row's completion runs on top of them.
In exact arithmetic this is the same computation (the backward sums each prompt's gradient over its rows, as
the repeated forward would); in float32 it differs by rounding only. Leaf module: tensors in, tensors out.

Layout. Row i's first loss position is f_i (position f_i predicts the first completion token); rows whose tokens
[0, f_i) agree share a prompt. The rows of one prompt also agree on every token up to the first one where any
two of them differ (the prompt's last token; a DPO pair's chosen and rejected often begin alike too), and the
states there depend on those tokens alone, so the shared prefix runs to that point e_g (at most each row's
length less one, so every row keeps a suffix token): a row's prefix is tokens [0, e_g), its suffix tokens
[e_g, length_i). Prefixes run as a (U, P) right-padded batch, one row per prompt; suffixes as an (N, S) batch
whose position ids continue at e_g and whose attention mask is the prefix's mask followed by the suffix's, so
each suffix attends to its own prefix's real keys only. A loss position inside the prefix takes the prefix's
state (shared by the group's rows, so its gradient sums over them); one past it, the suffix's.

On a CPU every position costs its matmuls, so suffixes of very different lengths (a GRPO group's replies that
stop early beside ones cut at the token limit) run in several calls, rows of like length together, each padded
to its own longest: `buckets` splits the rows where a call's fixed cost (CPU_CALL_POSITIONS) is less than the
padding it saves. Rows are independent given their prefix, so this changes no value.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from humanline_cli.core.batches import Seqs

# The shared path runs when its positions (Plan.positions) are at most this share of the padded batch's (N x T):
# above that its decoder calls cost more than the positions they save.
MAX_SHARE = 0.75

# A decoder call's fixed cost (its Python, dispatch and small-batch matmuls), in positions of a CPU step: a suffix
# batch splits where that saves more padded positions than this. On an accelerator, where positions cost little
# until the batch fills the device and a call costs its kernel launches, the suffixes run as one call.
CPU_CALL_POSITIONS = 8


@dataclass
class Plan:
    prefix_ids: torch.Tensor  # (U, P) one row per distinct prefix, right-padded
    prefix_mask: torch.Tensor  # (U, P) 1 on the prefix's tokens
    group: torch.Tensor  # (N,) the prefix row of each sequence
    start: torch.Tensor  # (N,) e_g: where each sequence's suffix starts
    suffix_ids: torch.Tensor  # (N, S)
    suffix_mask: torch.Tensor  # (N, S) 1 on the suffix's real tokens
    calls: list[tuple[torch.Tensor, int]]  # the suffix calls: their rows, and the width S_b they run at

    def positions(self) -> int:
        """Token positions the decoder runs on: U x P + the sum over suffix calls of rows x S_b."""
        return self.prefix_ids.numel() + sum(len(rows) * width for rows, width in self.calls)


# A batch's plan, keyed by its loss mask: the policy's forward, the reference's and the step's token count ask
# for the same batch's plan, and building one reads the ids on the host.
_PLANS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def cached_plan(seqs: Seqs) -> Plan | None:
    """plan(seqs), built once per batch (its tensors unchanged)."""
    hit = _PLANS.get(seqs.loss_mask)
    if hit is not None and hit[0] is seqs.input_ids and hit[1] is seqs.attention_mask:
        return hit[2]
    made = plan(seqs)
    _PLANS[seqs.loss_mask] = (seqs.input_ids, seqs.attention_mask, made)
    return made


def plan(seqs: Seqs) -> Plan | None:
    """The shared layout of `seqs`, or None where it does not pay (no prompt repeats, a row without completion
    tokens or without a prefix, or more than MAX_SHARE of the padded positions)."""
    loss = seqs.loss_mask[:, 1:]
    n, t = seqs.input_ids.shape
    if n < 2 or not bool(loss.any(1).all()):
        return None
    first_loss = loss.long().argmax(1).tolist()  # f_i
    if min(first_loss) < 1:
        return None
    ids, lens = seqs.input_ids.cpu(), seqs.attention_mask.sum(1).tolist()
    members: dict[tuple, list[int]] = {}  # each prompt's rows, in order of first appearance
    for i, f in enumerate(first_loss):
        members.setdefault(tuple(ids[i, :f].tolist()), []).append(i)
    u = len(members)
    if u == n:
        return None
    group, ends = [0] * n, list(first_loss)  # each row's prefix row; e_g
    for g, rows in enumerate(members.values()):
        for i in rows:
            group[i] = g
        if len(rows) < 2:  # a prompt of one row: its prefix stays the prompt (a longer one would pad the others')
            continue
        # the rows' common tokens: up to the first column where one differs from the first row, short of the
        # shortest row's last token
        last = min(lens[i] for i in rows) - 1
        differ = (ids[rows, :last] != ids[rows[0], :last]).any(0).nonzero()
        end = max(first_loss[rows[0]], int(differ[0]) if len(differ) else last)
        for i in rows:
            ends[i] = end
    device = seqs.input_ids.device
    start = torch.tensor(ends, device=device)
    suffix = [length - end for length, end in zip(lens, ends)]
    p, s = max(ends), max(suffix)
    group_t = torch.tensor(group, device=device)
    first_row = torch.tensor([rows[0] for rows in members.values()], device=device)
    cols = torch.arange(p, device=device)
    prefix_mask = (cols < start[first_row].unsqueeze(1)).long()
    prefix_ids = seqs.input_ids[first_row, :p] * prefix_mask  # positions past a prefix are masked: id 0 there
    at = start.unsqueeze(1) + torch.arange(s, device=device)  # (N, S) columns of each suffix
    inside = at < t
    at = at.clamp(max=t - 1)
    suffix_ids = seqs.input_ids.gather(1, at) * inside
    suffix_mask = seqs.attention_mask.gather(1, at) * inside
    calls = [(torch.tensor(rows, device=device), width)
             for rows, width in buckets(suffix, CPU_CALL_POSITIONS if device.type == "cpu" else None)]
    made = Plan(prefix_ids, prefix_mask, group_t, start, suffix_ids, suffix_mask.long(), calls)
    return made if made.positions() <= MAX_SHARE * n * t else None


def buckets(lengths: list[int], call_cost: int | None) -> list[tuple[list[int], int]]:
    """Rows by suffix length into calls, each (rows, its longest length), that minimise the positions run plus
    `call_cost` per call (None: one call). Rows sorted longest first, the best split into runs of that order
    (a call's rows are best consecutive in it) by dynamic programming over where each run starts."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if call_cost is None:
        return [(order, lengths[order[0]])]
    n = len(order)
    best, cut = [0.0] + [float("inf")] * n, [0] * (n + 1)  # best[j]: cost of the first j rows; cut[j]: last run's start
    for j in range(1, n + 1):
        for i in range(j):
            cost = best[i] + (j - i) * lengths[order[i]] + call_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    calls, j = [], n
    while j > 0:
        i = cut[j]
        calls.append((order[i:j], lengths[order[i]]))
        j = i
    return calls[::-1]


_SHARES = weakref.WeakKeyDictionary()  # decoder -> whether it runs the shared layout (fixed by its code and config)


def takes_a_cache(decoder: torch.nn.Module) -> bool:
    """Whether the decoder can run the shared layout: its forward takes a transformers cache and position ids (a
    model's own code may not), and its cache is a plain one (not sliding windows or hybrid layers)."""
    known = _SHARES.get(decoder)
    if known is None:
        known = _SHARES[decoder] = _plain_cache(decoder)
    return known


def _plain_cache(decoder: torch.nn.Module) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    accepts = inspect.signature(decoder.forward).parameters
    if getattr(decoder, "config", None) is None or not {"past_key_values", "position_ids"} <= accepts.keys():
        return False
    layers = DynamicCache(config=decoder.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def hidden_at(run_decoder, decoder: torch.nn.Module, plan: Plan, rows: torch.Tensor, cols: torch.Tensor
              ) -> torch.Tensor | None:
    """The decoder's final hidden states at positions (rows, cols) of the padded batch, computed on the shared
    layout: the prefixes once (cache built with grad), then every suffix on its prefix's keys and values.
    `run_decoder(decoder, **inputs)` calls the decoder (compiled or not). None for a decoder that cannot
    (takes_a_cache, which token_logps asks before planning)."""
    from transformers import DynamicCache

    if not takes_a_cache(decoder):
        return None
    cache = DynamicCache(config=decoder.config)
    before = run_decoder(decoder, input_ids=plan.prefix_ids, attention_mask=plan.prefix_mask,
                         past_key_values=cache, use_cache=True)
    kv = [(layer.keys, layer.values) for layer in cache.layers]
    pieces, base = [], torch.zeros_like(plan.start)  # each call's (rows x S_b, H) states; a row's first in them
    done = 0
    for call_rows, width in plan.calls:
        own_cache = DynamicCache(config=decoder.config)
        prefix_of = plan.group[call_rows]
        for layer, (k, v) in zip(own_cache.layers, kv):
            layer.update(k[prefix_of], v[prefix_of])
        positions = plan.start[call_rows].unsqueeze(1) + torch.arange(width, device=plan.start.device)
        mask = torch.cat([plan.prefix_mask[prefix_of], plan.suffix_mask[call_rows, :width]], dim=1)
        after = run_decoder(decoder, input_ids=plan.suffix_ids[call_rows, :width], attention_mask=mask,
                            position_ids=positions, past_key_values=own_cache, use_cache=True)
        pieces.append(last_hidden(after).flatten(0, 1))
        base[call_rows] = done + width * torch.arange(len(call_rows), device=base.device)
        done += width * len(call_rows)
    offset = cols - plan.start[rows]
    inside = (offset < 0).unsqueeze(1)  # a loss position within the shared prefix
    shared = last_hidden(before)[plan.group[rows], cols.clamp(max=plan.prefix_ids.shape[1] - 1)]
    own = torch.cat(pieces)[base[rows] + offset.clamp(min=0)]
    return torch.where(inside, shared, own)


def last_hidden(out) -> torch.Tensor:
    """A decoder call's final hidden states (a transformers output, or a model's own tuple)."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
