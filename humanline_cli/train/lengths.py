"""The run's lengths against the model's positions, from its config.json alone (before any weight
loads): a sequence longer than `max_position_embeddings` indexes past the position table (an
IndexError mid-sampling) or into positions the model never trained on (a silent wrong result).

The lengths against each other (prompt + sampled training tokens within train.max_length, everything
vLLM samples within its max_model_len) are config rules, checked earlier in config.check_lengths.
"""
from __future__ import annotations

from humanline_cli.config import RunSpec, eval_new_tokens, evaluates
from humanline_cli.errors import UserError


def model_positions(model_path: str, trust_remote_code: bool = False) -> int | None:
    """max_position_embeddings (GPT-2's n_positions maps to it) from config.json; None when the config
    cannot be read (load_policy reports that in one line) or names no limit."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError):
        return None
    limit = getattr(config, "max_position_embeddings", None)
    return limit if isinstance(limit, int) and limit > 0 else None


def check_model_lengths(spec: RunSpec, model_path: str) -> None:
    """One line naming the key and the model's limit: train.max_length (it bounds the training lengths,
    config.check_lengths), the evaluation's prompt + new tokens (generation only, not bounded by
    train.max_length) and the vLLM engine's max_model_len."""
    limit = model_positions(model_path, spec.model_cfg.trust_remote_code)
    if limit is None:
        return
    where = f"the model's max_position_embeddings ({limit}, {model_path}/config.json)"
    t = spec.train
    if t.max_length > limit:
        raise UserError(f"train.max_length ({t.max_length}) > {where}: set train.max_length<={limit}, and "
                        f"train.max_prompt_length, eval.max_new_tokens, data.max_new_tokens to fit within it "
                        f"(their defaults come from task.lengths)")
    new = eval_new_tokens(spec.eval_cfg, evaluates(spec.judge_cfg, spec.task_cfg))
    if t.max_prompt_length + new > limit:  # evaluation samples past train.max_length (config.check_lengths)
        key = "eval.max_new_tokens" if new == spec.eval_cfg.max_new_tokens else "eval.math500.max_new_tokens"
        raise UserError(f"train.max_prompt_length ({t.max_prompt_length}) + {key} ({new}) > {where}: "
                        f"lower {key}")
    s = spec.sampler_cfg
    if s.name == "vllm" and spec.regime == "online" and s.max_model_len > limit:
        raise UserError(f"sampler.max_model_len ({s.max_model_len}) > {where}: set sampler.max_model_len<={limit}")
