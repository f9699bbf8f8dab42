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

Two ways to run that layout:
- One packed row per prefix (`Tree`, on a CPU with sdpa or eager attention): the prefix, then each of its rows'
  suffixes back to back, no padding between them; position ids continue each suffix at e_g, and a 4D attention
  mask lets a suffix token see its prefix and its own earlier tokens only. The whole batch is ONE decoder call.
  On a CPU every call's backward writes a full set of weight gradients (430 MB for SmolLM2) that autograd then
  adds across calls, so one call costs the step least; positions run: U x the longest packed row.
- Two calls (elsewhere: an accelerator, where flash kernels take no 4D mask and a dense mask would compute every
  suffix against every other): the prefixes with a cache, then every suffix on its prefix's keys and values,
  right-padded to the longest suffix.
"""
from __future__ import annotations

import inspect
import weakref
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from humanline_cli.core import attention
from humanline_cli.core.batches import Seqs

# The shared path runs when its positions (Plan.positions) are at most this share of the padded batch's (N x T):
# above that its decoder calls cost more than the positions they save. The packed row is one decoder call, like
# the padded batch, so it pays wherever it saves positions at all; the two calls pay from a quarter saved.
MAX_SHARE = 0.75
MAX_SHARE_PACKED = 0.95

# The packed layout's mask is (U, R, R) booleans (float for eager attention): above this many elements (a long
# DPO pair on a CPU) the two-call layout runs instead.
TREE_MASK_LIMIT = 2**26

# Attention implementations that take a 4D mask as it is given (flash kernels take none; flex takes a block mask).
MASKED_ATTENTION = ("sdpa", "eager", attention.NAME)  # attention.NAME: sdpa, short calls in float32


@dataclass
class Tree:
    """The packed layout: row u holds prefix u's tokens then the suffixes of its rows, in row order."""
    ids: torch.Tensor  # (U, R) token ids, 0 past a row's end
    positions: torch.Tensor  # (U, R) position ids: 0.. over the prefix, e_g.. again over each suffix
    allowed: torch.Tensor  # (U, R, R) bool: query q may attend to key k
    at: torch.Tensor  # (N,) where each sequence's suffix starts in its prefix's packed row


@dataclass
class Plan:
    prefix_ids: torch.Tensor  # (U, P) one row per distinct prefix, right-padded
    prefix_mask: torch.Tensor  # (U, P) 1 on the prefix's tokens
    group: torch.Tensor  # (N,) the prefix row of each sequence
    start: torch.Tensor  # (N,) e_g: where each sequence's suffix starts
    suffix_ids: torch.Tensor  # (N, S)
    suffix_mask: torch.Tensor  # (N, S) 1 on the suffix's real tokens
    tree: Tree | None  # the packed layout, where it runs

    def positions(self) -> int:
        """Token positions the decoder runs on: U x R packed, else U x P + N x S."""
        return self.tree.ids.numel() if self.tree is not None else self.prefix_ids.numel() + self.suffix_ids.numel()


# A batch's plan, keyed by its loss mask: the policy's forward, the reference's and the step's token count ask
# for the same batch's plan, and building one reads the ids on the host.
_PLANS = WeakIdKeyDictionary()  # by identity: a tensor's == is elementwise


def cached_plan(seqs: Seqs, packed: bool) -> Plan | None:
    """plan(seqs, packed), built once per batch (its tensors unchanged)."""
    hit = _PLANS.get(seqs.loss_mask)
    if hit is not None and hit[0] is seqs.input_ids and hit[1] is seqs.attention_mask and hit[2] == packed:
        return hit[3]
    made = plan(seqs, packed)
    _PLANS[seqs.loss_mask] = (seqs.input_ids, seqs.attention_mask, packed, made)
    return made


def packs(decoder: torch.nn.Module, device: torch.device) -> bool:
    """Whether `decoder`'s shared layout runs packed (`Tree`): on a CPU, with attention that takes a 4D mask."""
    return device.type == "cpu" and getattr(decoder.config, "_attn_implementation", None) in MASKED_ATTENTION


def plan(seqs: Seqs, packed: bool) -> Plan | None:
    """The shared layout of `seqs`, packed where `packed` asks and its mask fits TREE_MASK_LIMIT, or None where it
    does not pay (no prompt repeats, a row without completion tokens or without a prefix, or more than MAX_SHARE
    of the padded positions: MAX_SHARE_PACKED packed)."""
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
    tree = None
    if packed:
        lengths = [ends[rows[0]] for rows in members.values()]  # each packed row's fill: its prefix first
        offsets = []  # where each row's suffix starts in its packed row
        for i, g in enumerate(group):
            offsets.append(lengths[g])
            lengths[g] += suffix[i]
        if u * max(lengths) ** 2 <= TREE_MASK_LIMIT:
            tree = _tree(ids, group, ends, suffix, offsets, max(lengths), device)
    made = Plan(prefix_ids, prefix_mask, group_t, start, suffix_ids, suffix_mask.long(), tree)
    return made if made.positions() <= (MAX_SHARE_PACKED if tree is not None else MAX_SHARE) * n * t else None


def _tree(source: torch.Tensor, group: list[int], ends: list[int], suffix: list[int], at: list[int], width: int,
          device: torch.device) -> Tree:
    """The packed rows from the batch's ids on the host (`source`): a prefix's tokens from its first row (segment 0),
    then each row's suffix (segment i + 1); a query attends causally within its segment and to its prefix's segment,
    never to padding (segment -1)."""
    u = max(group) + 1
    ids = torch.zeros(u, width, dtype=source.dtype)
    positions = torch.zeros(u, width, dtype=torch.long)
    segment = torch.full((u, width), -1, dtype=torch.long)
    seen = set()
    for i, g in enumerate(group):
        if g not in seen:
            seen.add(g)
            ids[g, :ends[i]] = source[i, :ends[i]]
            positions[g, :ends[i]] = torch.arange(ends[i])
            segment[g, :ends[i]] = 0
        span = slice(at[i], at[i] + suffix[i])
        ids[g, span] = source[i, ends[i]:ends[i] + suffix[i]]
        positions[g, span] = torch.arange(ends[i], ends[i] + suffix[i])
        segment[g, span] = i + 1
    q, k = segment.unsqueeze(2), segment.unsqueeze(1)
    causal = torch.ones(width, width, dtype=torch.bool).tril()
    allowed = causal & (k >= 0) & ((k == 0) | (k == q))  # every query sees key 0 (a prefix token): no empty row
    return Tree(ids.to(device), positions.to(device), allowed.to(device), torch.tensor(at, device=device))


_SHARES = weakref.WeakKeyDictionary()  # decoder -> whether it runs the shared layout (fixed by its code and config)


def can_share(decoder: torch.nn.Module) -> bool:
    """Whether the decoder can run the shared layout: its forward takes input embeddings, position ids and a
    transformers cache (a model's own code may not), and that cache is a plain one (no sliding windows or hybrid
    layers, whose masks a packed row's 4D mask would replace)."""
    known = _SHARES.get(decoder)
    if known is None:
        known = _SHARES[decoder] = _plain_cache(decoder)
    return known


def _plain_cache(decoder: torch.nn.Module) -> bool:
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    accepts = inspect.signature(decoder.forward).parameters
    if getattr(decoder, "config", None) is None or not callable(getattr(decoder, "get_input_embeddings", None)) \
            or not {"past_key_values", "position_ids", "inputs_embeds"} <= accepts.keys():
        return False
    layers = DynamicCache(config=decoder.config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def hidden_at(run_decoder, decoder: torch.nn.Module, plan: Plan, rows: torch.Tensor, cols: torch.Tensor
              ) -> torch.Tensor | None:
    """The decoder's final hidden states at positions (rows, cols) of the padded batch, computed on the shared
    layout (packed, or prefixes then suffixes: see the module docstring). A loss position inside a prefix takes the
    prefix's state. `run_decoder(decoder, **inputs)` calls the decoder (compiled or not). None for a decoder that
    cannot (can_share, which token_logps asks before planning)."""
    if not can_share(decoder):
        return None
    offset = cols - plan.start[rows]
    inside = offset < 0  # a loss position within the shared prefix
    if plan.tree is not None:
        tree = plan.tree
        embeds = decoder.get_input_embeddings()(tree.ids)
        allowed = tree.allowed.unsqueeze(1)  # (U, 1, R, R): every head alike
        if decoder.config._attn_implementation == "eager":  # eager attention adds its mask to the scores
            allowed = torch.zeros(allowed.shape, dtype=embeds.dtype, device=embeds.device).masked_fill(
                ~allowed, torch.finfo(embeds.dtype).min)
        out = run_decoder(decoder, inputs_embeds=embeds, attention_mask=allowed, position_ids=tree.positions,
                          use_cache=False)
        return last_hidden(out)[plan.group[rows], torch.where(inside, cols, tree.at[rows] + offset)]
    from transformers import DynamicCache

    # one embedding call for both decoder calls: each call's backward writes a dense vocabulary x hidden gradient
    n = plan.prefix_ids.numel()
    embeds = decoder.get_input_embeddings()(torch.cat([plan.prefix_ids.flatten(), plan.suffix_ids.flatten()]))
    cache = DynamicCache(config=decoder.config)
    before = run_decoder(decoder, inputs_embeds=embeds[:n].unflatten(0, plan.prefix_ids.shape),
                         attention_mask=plan.prefix_mask, past_key_values=cache, use_cache=True)
    own_cache = DynamicCache(config=decoder.config)
    for layer, prefix_layer in zip(own_cache.layers, cache.layers):
        layer.update(prefix_layer.keys[plan.group], prefix_layer.values[plan.group])
    width = plan.suffix_ids.shape[1]
    after = run_decoder(decoder, inputs_embeds=embeds[n:].unflatten(0, plan.suffix_ids.shape),
                        attention_mask=torch.cat([plan.prefix_mask[plan.group], plan.suffix_mask], dim=1),
                        position_ids=plan.start.unsqueeze(1) + torch.arange(width, device=plan.start.device),
                        past_key_values=own_cache, use_cache=True)
    shared = last_hidden(before)[plan.group[rows], cols.clamp(max=plan.prefix_ids.shape[1] - 1)]
    own = last_hidden(after)[rows, offset.clamp(min=0)]
    return torch.where(inside.unsqueeze(1), shared, own)


def last_hidden(out) -> torch.Tensor:
    """A decoder call's final hidden states (a transformers output, or a model's own tuple)."""
    return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
