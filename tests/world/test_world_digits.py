"""The difficulty knob task.world.digits: 3-digit addition, the noisy teacher dropping each carry independently
(so its errors fall geometrically with the number of carries); 2 digits keep their worlds and teacher exactly."""
from __future__ import annotations

import json
import random

import pytest

from humanline_cli.world import arithmetic
from humanline_cli.world.cache import materialise
from humanline_cli.world.naming import world_dir
from humanline_cli.world.rewards import score, subset


def test_carries_are_the_columns_that_carry_inside_the_width():
    assert arithmetic.carries("57+68=") == [0]          # 7 + 8 carries; 5 + 6 + 1 only writes the leading 1
    assert arithmetic.carries("50+60=") == []
    assert arithmetic.carries("999+001=") == [0, 1]     # 9 + 1, then 9 + 0 + 1
    assert arithmetic.carries("150+050=") == [1]        # only the tens
    assert arithmetic.carries("123+456=") == []
    assert arithmetic.dropped_carry("999+001=") == str(1000 - 10 - 100)  # 890: both carries lost
    assert arithmetic.dropped_carry("57+68=") == "115" and arithmetic.dropped_carry("123+456=") is None
    assert subset("arithmetic", "150+050=") == "carry" and subset("arithmetic", "123+456=") == "no_carry"
    assert score("arithmetic", "judge", ["999+001=", "999+001="], ["1000", "890"]) == [1.0, 0.0]


def test_two_digit_teacher_is_the_one_draw_per_carry_problem_it_always_was():
    def before(rng, prompt, carry_drop):  # the 2-digit teacher as it was written before the knob
        a, b = arithmetic.operands(prompt)
        if (a % 10) + (b % 10) >= 10 and rng.random() < carry_drop:
            return str(a + b - 10)
        if rng.random() < 0.2:
            return str(max(0, a + b + rng.choice((-1, 1))))
        return str(a + b)

    prompts = arithmetic.all_prompts()
    r1, r2 = random.Random(3), random.Random(3)
    assert [before(r1, p, 0.85) for p in prompts] == [arithmetic.teacher(r2, p, 0.85) for p in prompts]


def test_three_digit_teacher_drops_each_carry_independently():
    rng, n, drop = random.Random(0), 20000, 0.5
    replies = [arithmetic.teacher(rng, "999+001=", drop) for _ in range(n)]
    # two carries, each kept with 1 - drop: both lost 1/4, only the ones' (1000 - 10) 1/4, only the tens' 1/4,
    # none lost 1/4 (then right 80% of the time, off by one 20%)
    freq = {k: replies.count(k) / n for k in ("890", "990", "900", "1000", "999", "1001")}
    for k, p in (("890", 0.25), ("990", 0.25), ("900", 0.25), ("1000", 0.25 * 0.8), ("999", 0.025), ("1001", 0.025)):
        assert abs(freq[k] - p) < 0.015, (k, freq[k], p)


def test_digits_knob_names_worlds_and_is_checked(tmp_path):
    default = world_dir({"kind": "arithmetic"}, tmp_path)
    assert world_dir({"kind": "arithmetic", "digits": 2}, tmp_path) == default  # cached worlds keep their names
    assert world_dir({"kind": "arithmetic", "digits": 3}, tmp_path) != default
    with pytest.raises(ValueError, match="world.digits must be 2 or 3, not 4"):
        world_dir({"kind": "arithmetic", "digits": 4}, tmp_path)
    with pytest.raises(ValueError, match="unknown key"):
        world_dir({"kind": "preference", "digits": 3}, tmp_path)
    assert len(arithmetic.all_prompts(3)) == 10**6 and arithmetic.all_prompts(3)[1001] == "001+001="


def test_a_three_digit_world_builds(tmp_path):
    cfg = {"kind": "arithmetic", "digits": 3, "format": "plain", "n_train_prompts": 32, "n_eval_prompts": 32,
           "sft": {"steps": 4, "batch_size": 8, "warmup": 1}}
    d = materialise(cfg, tmp_path, progress=False)
    prompts = [json.loads(x)["prompt"][0]["content"] for x in (d / "prompts_eval.jsonl").read_text().splitlines()]
    assert len(prompts) == 32 and all(len(p) == 8 and p[3] == "+" for p in prompts)
    pairs = [json.loads(x) for x in (d / "offline_pairs.jsonl").read_text().splitlines()]
    replies = [int(r[k][0]["content"]) for r in pairs for k in ("chosen", "rejected")]
    assert replies and all(0 <= v <= 1998 for v in replies)  # the rule-based other model: [0, 2 * 10^3 - 2]
    base = json.loads((d / "world.json").read_text())["base_metrics"]
    assert base["n_eval"] == 32 and 0.0 <= base["greedy_accuracy"] <= 1.0 and "greedy_accuracy_carry" in base


def test_three_digit_split_draws_without_building_every_problem():
    train, eval_, pool = arithmetic.split_prompts(random.Random(0), 300, 200, digits=3)
    assert len(train) == 300 and len(eval_) == 200 and not set(train) & set(eval_)
    assert len(pool) == 10**6 - 200 and not set(eval_) & {pool[i] for i in range(0, len(pool), 997)}
    # the pool is every problem but the eval ones, in index order: check it against the list itself
    small = arithmetic.PromptPool(3, [0, 1, 5, 999_999])
    full = [p for p in arithmetic.all_prompts(3) if p not in {"000+000=", "000+001=", "000+005=", "999+999="}]
    assert len(small) == len(full) and [small[i] for i in (0, 1, 2, 3, 500_000, len(full) - 1)] == \
        [full[i] for i in (0, 1, 2, 3, 500_000, len(full) - 1)]
    with pytest.raises(IndexError):
        small[len(full)]
    # two digits keep the shuffle of all 10^4 problems they always had (cached worlds keep their content)
    rng, ref = random.Random(7), arithmetic.all_prompts()
    random.Random(7).shuffle(ref)
    tr2, ev2, pool2 = arithmetic.split_prompts(rng, 100, 50)
    assert ev2 == ref[:50] and tr2 == ref[50:150] and pool2 == ref[50:]
