"""The paper's settings predicted: `python -m humanline_cli.lab.paper_speed` prints docs/performance.md's table
(paper_math and paper_instruction_following; online, stale-64, humanline; 1 and 8 H100 / H200). The work comes
from the composed configs; prompt and completion lengths are each setting's stated assumptions. ESTIMATES.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from humanline_cli.core.objectives import PROPERTIES
from humanline_cli.lab.predict import Work, predict
from humanline_cli.lab.speed import reference_syncs
from humanline_cli.lab.targets import ASSUMED, GPUS, SHAPES, gpu_target
from humanline_cli.mdtable import md_table
from humanline_cli.report.cost import Call
from humanline_cli.report.frame import humanline_spec


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


SETTINGS = (
    Setting("paper_math ({objective}, Qwen2.5-1.5B-Instruct)", "qwen2_5_1_5b_instruct", 200, 600, 2048,
            "math verifier (CPU)", ASSUMED["verifier_s_per_seq"],
            (("online", ["experiment=paper_math"]),
             ("stale-64", ["experiment=paper_math", "regime=stale64"]),
             ("humanline stale-64 (sync 16)", ["experiment=paper_math", "regime=hl_stale64_sync16_lo15"]))),
    Setting("paper_instruction_following ({objective}, Llama-3-8B-Instruct)", "llama3_8b_instruct", 300, 400, 1024,
            # ArmoRM (Llama-3-8B) scoring 700 tokens of prompt + completion: a forward, 2 x P x tokens at the assumed MFU
            "ArmoRM reward model (8B forward)",
            2 * SHAPES["llama3_8b_instruct"].matmul_params * 700 / (ASSUMED["mfu"] * GPUS["h100"][0]),
            (("online", ["experiment=paper_instruction_following", "data=online"]),
             ("stale-64", ["experiment=paper_instruction_following", "data=online",
                           "data.generate_every=64"]),
             ("humanline-offline", ["experiment=paper_instruction_following", "data=offline",
                                    "humanline=true"]))),
)


def counted_work(cfg, setting: Setting, gpus: int) -> Work:
    """The work of one run of the composed config `cfg` under the setting's length assumptions; what a unit is
    comes from the objective's PROPERTIES."""
    shape, props = SHAPES[setting.model], PROPERTIES[cfg.objective.name]
    steps, batch, n = int(cfg.train.steps), int(cfg.train.batch_size), int(cfg.data.n)
    calls: tuple = ()
    if cfg.data.regime == "online":
        k = cfg.data.get("generate_every")
        prompts = k * batch // props.units_per_prompt if k else int(cfg.data.prompts_per_round)
        n_calls = math.ceil(steps / (k or max(1, prompts * props.units_per_prompt // batch)))
        calls = tuple(Call(prompts * n, round(prompts * n * setting.completion_tokens), setting.longest)
                      for _ in range(n_calls))
    tokens = props.sequences(steps * batch, n) * (setting.prompt_tokens + setting.completion_tokens)
    spec = humanline_spec({f"hl.{k}": v for k, v in cfg.hl.items()}, cfg.humanline)
    return Work(params=shape.matmul_params, weight_bytes=2 * shape.params, calls=calls, steps=steps,
                train_tokens=tokens, reference_forward=True, gradient_checkpointing=bool(cfg.train.gradient_checkpointing),
                syncs=reference_syncs(spec, str(cfg.data.regime), steps, len(calls)))


def rows() -> list[dict]:
    """Each setting's regimes predicted on 1 and 8 H100 and H200 GPUs, speedups against its first (online)."""
    from hydra import compose, initialize_config_module

    out = []
    with initialize_config_module(config_module="conf", version_base="1.3"):
        for s in SETTINGS:
            cfgs = [(name, compose("train", overrides=o)) for name, o in s.regimes]  # the objective: conf's default
            works = [(name, counted_work(c, s, 1)) for name, c in cfgs]
            title = s.name.format(objective=cfgs[0][1].objective.name.upper())
            for gpu, gpus in itertools.product(("h100", "h200"), (1, 8)):
                t = gpu_target(gpu, SHAPES[s.model], gpus, s.prompt_tokens + s.completion_tokens / 2, s.label_s_per_seq)
                base = predict(works[0][1], t)
                out += [{"setting": s, "title": title, "regime": name, "target": t, "work": w,
                         "predicted": (p := predict(w, t)), "speedup": base["loop"] / p["loop"]} for name, w in works]
    return out


def markdown() -> list[str]:
    def h(r, k):
        return f"{r['predicted'][k] / 3600:.2f}"

    return ["ESTIMATES (public figures and assumed efficiencies; lab/targets.py). Hours per phase of the training "
            "loop (setup, evaluation and saving left out); speedup = online's loop over the regime's at equal steps, "
            "which here is also equal units trained. The last seven columns are the assumptions each row rests on.", "",
            *md_table(["setting", "regime", "GPUs", "calls x sequences", "generate h", "push h", "label h", "train h",
                       "sync h", "loop h", "speedup vs online (equal steps)", "prompt + completion tokens (mean)",
                       "longest per call", "decode tok/s per GPU (peak)", "decode ms/step (latency)", "training MFU",
                       "label s/seq", "push fixed s"],
                      [(r["title"], r["regime"], t.name,
                        f"{len(w.calls)} x {w.calls[0].sequences}" if w.calls else "0 (data sampled before)",
                        *(h(r, k) for k in ("sample", "push", "label", "train", "sync")), f"**{h(r, 'loop')}**",
                        f"**{r['speedup']:.2f}x**", f"{s.prompt_tokens:g} + {s.completion_tokens:g}", s.longest,
                        f"{t.sample_tokens_per_s:.3g}", f"{1e3 * t.decode_step_s:.3g}",
                        f"{t.train_flops_per_s / GPUS[t.name[-4:]][0]:g}", f"{s.label_s_per_seq:.3g} ({s.label})",
                        f"{t.push_fixed_s:g}")
                       for r in rows() for s, t, w in [(r["setting"], r["target"], r["work"])]])]


if __name__ == "__main__":
    print("\n".join(markdown()))
