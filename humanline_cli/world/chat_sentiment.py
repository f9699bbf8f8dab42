"""Short replies for a real instruct model, scored by sentiment lexicons (task=chat_sentiment): an unverifiable
task that installs offline. Each prompt asks for a one-sentence reply to something a person says; a situation
crossed with a reply style gives 40 x 4 = 160 distinct prompts, shuffled by the generator's seed, eval drawn
first then train (disjoint). No answer: the labeller (VADER) and the judge (AFINN) score the reply alone.

Consumes a task generator cfg (schema.TaskGeneratorConfig: kind, n_train, n_eval, seed; the arithmetic knobs are
not read); world/generated.py writes the rows into `<cache_root>/chat_sentiment-<hash12>/`.
"""
from __future__ import annotations

import random
from collections.abc import Mapping

from humanline_cli.errors import UserError

NAME = "chat_sentiment"
VERSION = 1  # bump when a change here changes what a build writes
SITUATIONS = (
    "I missed my bus this morning.", "My sister got a new job.", "It rained all weekend.",
    "I finished my first marathon.", "My laptop broke before the deadline.", "We adopted a puppy.",
    "The restaurant lost our reservation.", "I passed my driving test.", "My flight was cancelled.",
    "I planted tomatoes in the garden.", "The meeting ran two hours late.", "I learned to bake bread.",
    "My phone screen cracked.", "Our team won the match.", "I have a cold again.", "I moved to a new city.",
    "The train was packed today.", "My friend forgot my birthday.", "I started learning the piano.",
    "The power went out last night.", "I got a parking ticket.", "My grandmother is visiting.",
    "I burned the dinner.", "We finished painting the kitchen.", "My exam results came back.",
    "The neighbours are noisy again.", "I found my lost keys.", "My bike got a flat tyre.",
    "I am starting a new course.", "The coffee machine at work is broken.", "I ran into an old friend.",
    "My plants keep dying.", "I got a promotion.", "The shop was out of bread.", "I finally fixed the sink.",
    "My cat knocked over a vase.", "I am nervous about tomorrow's interview.", "It is snowing outside.",
    "I lost the chess tournament.", "My brother is getting married.",
)
STYLES = ("Reply in one short sentence to a friend who says: \"{}\"",
          "A colleague tells you: \"{}\" Answer in one sentence.",
          "Write a brief reply (one sentence) to this message: \"{}\"",
          "Your neighbour says: \"{}\" What do you say back? One sentence.")


def check(cfg: Mapping) -> dict:
    """The cfg's keys this generator reads, as a plain dict, or a one-line UserError naming the bad key."""
    full = {k: cfg[k] for k in ("kind", "n_train", "n_eval", "seed")}
    if full["kind"] != NAME:
        raise UserError(f"config key 'task.generator.kind': unknown generator {full['kind']!r} ({NAME})")
    if int(full["n_train"]) < 1 or int(full["n_eval"]) < 1:
        raise UserError("config keys 'task.generator.n_train' and 'n_eval' must be at least 1")
    space = len(SITUATIONS) * len(STYLES)
    if int(full["n_train"]) + int(full["n_eval"]) > space:
        raise UserError(f"task.generator: {full['n_train']} + {full['n_eval']} prompts do not fit in the {space} "
                        "distinct chat_sentiment prompts")
    return full


def generate(cfg: Mapping) -> tuple[list[dict], list[dict]]:
    """(train rows, eval rows) of {"prompt": ...}, seeded by cfg['seed'], eval drawn first then train."""
    full = check(cfg)
    prompts = [style.format(s) for s in SITUATIONS for style in STYLES]
    random.Random(f"{NAME}:{full['seed']}").shuffle(prompts)
    rows = [{"prompt": p} for p in prompts[:int(full["n_eval"]) + int(full["n_train"])]]
    return rows[int(full["n_eval"]):], rows[:int(full["n_eval"])]
