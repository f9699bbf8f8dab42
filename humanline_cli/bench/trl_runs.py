"""`humanline bench`'s TRL side: DPOTrainer / KTOTrainer.train on the project's units, GRPOTrainer's loss path on
the project's fixed groups (its trainer only trains on its own generations), and GRPOTrainer.train online."""
from __future__ import annotations

import contextlib
import copy
import io
import math
import tempfile
import warnings

import torch

from humanline_cli.bench.clock import Run, _now, collect, load_model
from humanline_cli.core.objectives import OBJECTIVES


def trl_available() -> bool:
    try:
        with _quiet():
            import trl  # noqa: F401
    except ImportError:
        return False
    return True


@contextlib.contextmanager
def _quiet():
    """TRL's and datasets' progress bars, end-of-train prints and import-time warnings would bury the table."""
    import datasets

    was = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        if was:
            datasets.enable_progress_bars()


def _setup(spec, info: dict):
    """(tokenizer, encoder, policy) as the project's run loads them, torch's threads set."""
    from humanline_cli.models import load_tokenizer
    from humanline_cli.train.build import make_encoder, model_paths

    policy, _ = load_model(spec, info["backend"].device)
    tokenizer = load_tokenizer(model_paths(spec)[1], spec.model_cfg.trust_remote_code)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    return tokenizer, make_encoder(spec, tokenizer), policy


def _clock(device, ends: list):
    """A TrainerCallback appending (time, tokens seen) at the end of every optimizer step."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append((_now(device), state.num_input_tokens_seen))

    return Clock()


def _timed(ends: list, sizes: list, warmup: int, args) -> Run:
    """Step k+1 (1-based) ran between the ends of steps k and k+1: the first `warmup` steps untimed."""
    return collect([0.0, *(t for t, _ in ends[:-1])], ends[-1][0], sizes, warmup, _precision(args))


def _precision(args) -> str:
    """What TRL's trainer computed in: bf16=True (autocast over fp32 weights) or fp32."""
    return "bfloat16" if args.bf16 else "fp32"


def _as_chat(rows: list[dict], wrap: bool) -> list[dict]:
    """Give TRL the conversation the project's encoder builds when it wraps plain strings in a chat turn."""
    if not wrap:
        return rows
    role = {"prompt": "user"}
    return [{k: ([{"role": role.get(k, "assistant"), "content": v}] if isinstance(v, str) else v) for k, v in r.items()}
            for r in rows]


def _trl_common(spec, backend, out_dir: str, grpo: bool = False) -> dict:
    """TrainingArguments of the project's run (GRPOConfig has no max_length; its scheduler runs without min_lr)."""
    tr = spec.train
    common = dict(output_dir=out_dir, max_steps=tr.steps, per_device_train_batch_size=tr.micro_batch_size,
                gradient_accumulation_steps=tr.accumulation, learning_rate=tr.lr, weight_decay=tr.weight_decay,
                warmup_steps=math.ceil(tr.warmup_ratio * tr.steps), max_grad_norm=tr.max_grad_norm,
                lr_scheduler_type="cosine_with_min_lr" if tr.schedule == "cosine" else "constant_with_warmup",
                **({"lr_scheduler_kwargs": {"min_lr": 0.0}} if tr.schedule == "cosine" else {}),
                optim="adamw_torch", gradient_checkpointing=tr.gradient_checkpointing,
                bf16=backend.autocast_dtype == torch.bfloat16,
                fp16=False, use_cpu=backend.device.type == "cpu", report_to="none", save_strategy="no",
                logging_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=spec.seed,
                max_length=tr.max_length, beta=spec.objective_cfg.beta)
    for key in ("max_length", "lr_scheduler_kwargs") if grpo else ():
        common.pop(key, None)
    return common


def peer(spec):
    """The TRL counterpart the objective names (core/objectives/), None where it has none."""
    return OBJECTIVES[spec.objective].trl_peer(spec.objective_cfg)


def trl_run(spec, info: dict, warmup: int, precompute: bool = False) -> Run:
    """The objective's TRL trainer (DPOTrainer, KTOTrainer, ...).train on the units the project's steps draw, as
    rows of TRL's dataset; `precompute`: precompute_ref_log_probs (TRL's reference pass over the data runs before
    the first step). A trainer that trains only on its own generations times its loss path instead (trl_grpo_run)."""
    from datasets import Dataset

    p = peer(spec)
    if p.row is None:
        return trl_grpo_run(spec, info, warmup)
    tokenizer, encoder, policy = _setup(spec, info)
    units = info["units"][: spec.train.batch_size * spec.train.steps]  # as many as the project's steps draw
    data = Dataset.from_list(_as_chat([p.row(u) for u in units], encoder.wrap_strings))
    ref = copy.deepcopy(policy).eval().requires_grad_(False)
    ends: list = []
    with tempfile.TemporaryDirectory() as tmp:
        import trl

        Config, Trainer = getattr(trl, f"{p.trainer}Config"), getattr(trl, f"{p.trainer}Trainer")
        args = Config(**_trl_common(spec, info["backend"], tmp), precompute_ref_log_probs=precompute, **p.args)
        trainer = Trainer(model=policy, ref_model=ref, args=args, train_dataset=data, processing_class=tokenizer,
                          callbacks=[_clock(info["backend"].device, ends)])
        collate, counts = trainer.data_collator, []  # (tokens, KL tokens) of each batch TRL's collator builds

        def counting(examples):
            batch = collate(examples)
            kl = batch.get("KL_attention_mask", batch.get("kl_attention_mask"))
            counts.append((int(batch["attention_mask"].sum()), int(kl.sum()) if kl is not None else 0))
            return batch

        trainer.data_collator = counting
        trainer.train()
    acc = spec.train.accumulation
    steps = [counts[k * acc:(k + 1) * acc] for k in range(len(ends))]
    return _timed(ends, [(spec.train.batch_size, sum(t for t, _ in s), sum(kl for _, kl in s)) for s in steps], warmup,
                  args)


def trl_grpo_run(spec, info: dict, warmup: int) -> Run:
    """TRL's GRPO loss path (GRPOTrainer.compute_loss) on the project's fixed groups."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from humanline_cli.data.collate import Collator

    backend = info["backend"]
    tokenizer, encoder, policy = _setup(spec, info)  # TRL loads its reference
    collate = Collator(encoder, spec.objective_cfg)
    units, tr = info["units"], spec.train
    group = len(units[0].completions)
    # the loss path gets no num_items_in_batch (Trainer.train passes it), so dapo's normaliser is timed as grpo's
    own = {**peer(spec).args}
    own["loss_type"] = "grpo" if own["loss_type"] == "dapo" else own["loss_type"]
    with tempfile.TemporaryDirectory() as tmp:
        common = _trl_common(spec, backend, tmp, grpo=True)
        n = tr.micro_batch_size * group
        args = GRPOConfig(**common, num_generations=group, generation_batch_size=n,
                          max_completion_length=tr.max_length - tr.max_prompt_length, scale_rewards="none", **own)
        args.per_device_train_batch_size = n
        trainer = GRPOTrainer(model=policy, reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                              args=args, train_dataset=Dataset.from_list([{"prompt": "x"}] * n),
                              processing_class=tokenizer)
        trainer.create_optimizer_and_scheduler(num_training_steps=tr.steps)
        trainer.current_gradient_accumulation_steps = tr.accumulation
        model, opt, sched = trainer.model, trainer.optimizer, trainer.lr_scheduler
        model.train()
        params = [p for p in model.parameters() if p.requires_grad]
        g = torch.Generator().manual_seed(spec.seed)
        order: list[int] = []
        starts, sizes = [], []
        for _step in range(tr.steps):
            starts.append(_now(backend.device))
            while len(order) < tr.batch_size:  # epochs of shuffled groups, like the offline source
                order += torch.randperm(len(units), generator=g).tolist()
            idx, order = order[:tr.batch_size], order[tr.batch_size:]
            toks = 0
            for s in range(0, tr.batch_size, tr.micro_batch_size):
                mb = [units[i] for i in idx[s:s + tr.micro_batch_size]]
                inputs = _grpo_inputs(collate(mb), tokenizer.pad_token_id, backend.device)
                with backend.autocast():
                    with torch.no_grad():
                        inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                            trainer.ref_model, inputs["input_ids"], inputs["attention_mask"],
                            inputs["completion_ids"].shape[1])[0]
                    loss = trainer.compute_loss(model, inputs)
                loss.backward()
                toks += int(inputs["attention_mask"].sum())
            torch.nn.utils.clip_grad_norm_(params, tr.max_grad_norm)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            float(loss.detach())  # the project's loop reads the loss every step too
            sizes.append((tr.batch_size, toks, 0))
        end = _now(backend.device)
    return collect(starts, end, sizes, warmup, _precision(args))


def _grpo_inputs(batch, pad_id: int, device) -> dict:
    """The project's GroupBatch (right-padded prompt+completion) -> TRL's left-padded prompts and
    right-padded completions with the same token ids and group-normalised advantages."""
    from torch.nn.utils.rnn import pad_sequence

    seqs = batch.seqs
    prompts, comps = [], []
    for ids, att, lm in zip(seqs.input_ids, seqs.attention_mask, seqs.loss_mask):
        n, start = int(att.sum()), int(lm.nonzero()[0]) if lm.any() else int(att.sum())
        prompts.append(ids[:start])
        comps.append(ids[start:n])
    comps.append(torch.zeros(1, dtype=torch.long))  # at least one column, dropped below
    out = {}
    for key, side, parts in (("prompt", "left", prompts), ("completion", "right", comps)):
        out[f"{key}_ids"] = pad_sequence(parts, True, pad_id, side)[:len(prompts)]
        out[f"{key}_mask"] = pad_sequence([torch.ones_like(p) for p in parts], True, 0, side)[:len(prompts)]
    out = {k: v.to(device) for k, v in {**out, "advantages": batch.advantages.float()}.items()}
    out["input_ids"] = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    out["attention_mask"] = torch.cat([out["prompt_mask"], out["completion_mask"]], 1)
    return out


def trl_online_grpo_run(spec, info: dict, warmup: int) -> Run:
    """GRPOTrainer.train on the task's train prompts, generating its own groups of data.n, scored by the task's
    labeller: one generation of train.batch_size prompts per optimizer step, as the project's rounds under
    data.generate_every=1. Per step: the prompts (distinct row indices the reward function saw), completions and
    tokens (TRL's num_input_tokens_seen: prompt + completion)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from humanline_cli.data.files import load_rows
    from humanline_cli.rewards.scorers import checked
    from humanline_cli.train.build import make_labeller, resolve_path

    backend, tr, d = info["backend"], spec.train, spec.data_cfg
    tokenizer, encoder, policy = _setup(spec, info)  # TRL loads its reference
    p = spec.task_cfg.prompts
    rows, _ = load_rows(resolve_path(d.prompts, spec), p.train_split, d.limit, p.columns)
    data = Dataset.from_list(_as_chat([{"idx": i, **{k: r[k] for k in ("prompt", "answer") if k in r}}
                                       for i, r in enumerate(rows)], encoder.wrap_strings))
    name, labeller = make_labeller(spec, backend.device)
    seen: list[tuple[int, int]] = []  # per generation: (distinct prompts, completions)

    def task_reward(prompts, completions, idx, answer=None, **_):
        comps = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        seen.append((len(set(idx)), len(comps)))
        return checked(name, labeller, [encoder.prompt_text(p) for p in prompts], comps, answer)

    micro = info.get("micro_batch_size", tr.micro_batch_size)  # as fitted by the project's run
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": tr.max_length,
            "vllm_gpu_memory_utilization": spec.sampler_cfg.gpu_memory_utilization} \
        if spec.sampler_cfg.name == "vllm" else {}
    ends: list = []
    with tempfile.TemporaryDirectory() as tmp:
        common = _trl_common(spec, backend, tmp, grpo=True)
        common.update(per_device_train_batch_size=micro * d.n, gradient_accumulation_steps=tr.batch_size // micro)
        args = GRPOConfig(**common, num_generations=d.n, max_completion_length=d.max_new_tokens,
                          temperature=d.temperature, top_p=d.top_p, shuffle_dataset=True, **peer(spec).args, **vllm)
        trainer = GRPOTrainer(model=policy, reward_funcs=[task_reward], args=args, train_dataset=data,
                              processing_class=tokenizer, callbacks=[_clock(backend.device, ends)])
        trainer.train()
    tokens = [b - a for (_, a), (_, b) in zip([(0.0, 0), *ends], ends)]
    return _timed(ends, [(u, t, 0, c) for (u, c), t in zip(seen, tokens)], warmup, args)
