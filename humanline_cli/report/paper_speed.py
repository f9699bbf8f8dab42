"""The paper's settings, predicted: `python -m humanline_cli.report.paper_speed` prints the Markdown table of
docs/performance.md (experiment=paper_math and paper_instruction_following; online vs stale-64 vs
humanline-offline; 1 and 8 H100 / H200 GPUs), every assumption in a column.

The counted work comes from the composed configs (steps, batch, samples per prompt, generate_every,
prompts_per_round, gradient checkpointing, humanline's sync period); what a config cannot say (how long the
prompts and completions are) is an assumption of each setting below, stated in the table. Every number is an
ESTIMATE: the targets are built on public figures and assumed efficiencies (report/targets.py).
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass

from humanline_cli.core.humanline import HumanlineSpec
from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.report.predict import Call, Work, predict
from humanline_cli.report.speed import reference_syncs
from humanline_cli.report.targets import ASSUMED, GPUS, SHAPES, gpu_target


@dataclass(frozen=True)
class Setting:
    name: str
    model: str
    prompt_tokens: float       # mean prompt tokens (assumed)
    completion_tokens: float   # mean completion tokens (assumed)
    longest: int               # the longest completion of a call (assumed: the cap, max_new_tokens)
    label: str                 # how completions are labelled
    label_s_per_seq: float     # per completion on one GPU (assumed / derived below)
    regimes: tuple             # (name, Hydra overrides)


def _reward_model_s_per_seq(tokens: float) -> float:
    """ArmoRM (Llama-3-8B) scoring one prompt + completion: a forward, 2 x P x tokens at the assumed MFU."""
    return 2 * SHAPES["llama3_8b_instruct"].matmul_params * tokens / (ASSUMED["mfu"] * GPUS["h100"][0])


SETTINGS = (
    Setting("paper_math (GRPO, Qwen2.5-1.5B-Instruct)", "qwen2_5_1_5b_instruct", 200, 600, 2048,
            "math verifier (CPU)", ASSUMED["verifier_s_per_seq"],
            (("online", ["experiment=paper_math"]),
             ("stale-64", ["experiment=paper_math", "regime=stale64"]),
             ("humanline stale-64 (sync 16)", ["experiment=paper_math", "regime=hl_stale64_sync16_lo15"]))),
    Setting("paper_instruction_following (DPO, Llama-3-8B-Instruct)", "llama3_8b_instruct", 300, 400, 1024,
            "ArmoRM reward model (8B forward)", _reward_model_s_per_seq(700),
            (("online", ["experiment=paper_instruction_following", "objective=dpo", "data=online"]),
             ("stale-64", ["experiment=paper_instruction_following", "objective=dpo", "data=online",
                           "data.generate_every=64"]),
             ("humanline-offline", ["experiment=paper_instruction_following", "objective=dpo", "data=offline",
                                    "humanline=true"]))),
)


def counted_work(cfg, setting: Setting, gpus: int) -> Work:
    """The work of one run of the composed config `cfg` under the setting's length assumptions."""
    shape = SHAPES[setting.model]
    steps, batch = int(cfg.train.steps), int(cfg.train.batch_size)
    props = PROPERTIES[cfg.objective.name]  # what a unit is, for this objective: the method's own entry
    online = cfg.data.regime == "online"
    seqs_per_unit = props.seqs_per_unit or int(cfg.data.n)  # 0: a GRPO group, data.n samples of one prompt
    calls: tuple = ()
    if online:
        per_prompt_units = props.units_per_prompt
        k = cfg.data.get("generate_every")
        prompts = k * batch // per_prompt_units if k else int(cfg.data.prompts_per_round)
        steps_per_call = k or max(1, prompts * per_prompt_units // batch)
        n_calls = math.ceil(steps / steps_per_call)
        m = prompts * int(cfg.data.n)
        calls = tuple(Call(m, round(m * setting.completion_tokens), setting.longest) for _ in range(n_calls))
    tokens = steps * batch * seqs_per_unit * (setting.prompt_tokens + setting.completion_tokens)
    spec = HumanlineSpec(sync=bool(cfg.humanline) and bool(cfg.hl.sync), sync_every=int(cfg.hl.sync_every))
    syncs = reference_syncs(spec, str(cfg.data.regime), steps, len(calls))
    return Work(params=shape.matmul_params, weight_bytes=2 * shape.params, calls=calls, steps=steps,
                train_tokens=tokens, reference_forward=True,
                gradient_checkpointing=bool(cfg.train.gradient_checkpointing), syncs=syncs)


def rows() -> list[dict]:
    from hydra import compose, initialize_config_module

    out = []
    with initialize_config_module(config_module="conf", version_base="1.3"):
        for s in SETTINGS:
            ctx = s.prompt_tokens + s.completion_tokens / 2
            works = [(name, counted_work(compose("train", overrides=o), s, 1)) for name, o in s.regimes]
            for gpu in ("h100", "h200"):
                for gpus in (1, 8):
                    t = gpu_target(gpu, SHAPES[s.model], gpus, ctx, s.label_s_per_seq)
                    base = None
                    for name, w in works:
                        p = predict(w, t)
                        base = base or p
                        out.append({"setting": s, "regime": name, "target": t, "work": w, "predicted": p,
                                    "speedup": base["loop"] / p["loop"]})
    return out


def _h(seconds: float) -> str:
    return f"{seconds / 3600:.2f}"


def markdown() -> list[str]:
    out = ["ESTIMATES (public figures and assumed efficiencies; report/targets.py). Hours per phase of the training "
           "loop (setup, evaluation and saving left out); speedup = online's loop over the regime's at equal steps, "
           "which here is also equal units trained. The last seven columns are the assumptions each row rests on.", "",
           "| setting | regime | GPUs | calls x sequences | generate h | push h | label h | train h | sync h | loop h | "
           "speedup vs online (equal steps) | prompt + completion tokens (mean) | longest per call | decode tok/s per "
           "GPU (peak) | decode ms/step (latency) | training MFU | label s/seq | push fixed s |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows():
        s, t, w, p = r["setting"], r["target"], r["work"], r["predicted"]
        calls = f"{len(w.calls)} x {w.calls[0].sequences}" if w.calls else "0 (data sampled before)"
        out.append(f"| {s.name} | {r['regime']} | {t.name} | {calls} | {_h(p['sample'])} | {_h(p['push'])} | "
                   f"{_h(p['label'])} | {_h(p['train'])} | {_h(p['sync'])} | **{_h(p['loop'])}** | "
                   f"**{r['speedup']:.2f}x** | {s.prompt_tokens:g} + {s.completion_tokens:g} | {s.longest} | "
                   f"{t.sample_tokens_per_s:.3g} | {1e3 * t.decode_step_s:.3g} | "
                   f"{t.train_flops_per_s / GPUS[t.name[-4:]][0]:g} | "
                   f"{s.label_s_per_seq:.3g} ({s.label}) | {t.push_fixed_s:g} |")
    return out


if __name__ == "__main__":
    print("\n".join(markdown()))
    sys.exit(0)
