"""Reward model labeller/judge: any AutoModelForSequenceClassification (ArmoRM-style) scoring the
chat-formatted (prompt, completion) conversation, batched, without gradients.

Scores are the model's scalar output (logit 0 for one-label heads; the `score` attribute for
models that return one, like ArmoRM with trust_remote_code)."""
from __future__ import annotations

import copy

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from humanline_cli.models import (
    check_loaded,
    load_error,
    provide_removed_names,
    quiet_load,
    refuse_own_code_unless_trusted,
)


class RewardModel:
    def __init__(self, path: str, device=None, batch_size: int = 16, trust_remote_code: bool = False,
                 max_length: int = 4096, trust_key: str = "reward.trust_remote_code",
                 key: str = "reward.name_or_path"):
        """`trust_key` is the config key that turns remote code on for this model, named in the
        one-line error when the model needs it (task.judge..., task.labeller..., reward...); `key` is
        the key naming the model, in the error for a checkpoint without a trained score head."""
        refuse_own_code_unless_trusted("reward model", path, "AutoModelForSequenceClassification", trust_remote_code,
                                       trust_key)
        if trust_remote_code:
            provide_removed_names()  # ArmoRM's own code imports a name transformers 5 dropped
        try:
            self.tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            model, info = quiet_load(AutoModelForSequenceClassification.from_pretrained,
                                     path, use_safetensors=True, trust_remote_code=trust_remote_code,
                                     output_loading_info=True)
        except Exception as e:  # OSError, ValueError, a corrupted file, an ImportError in the model's own code
            raise load_error("reward model", path, e, trust_key) from None
        check_loaded("reward model (AutoModelForSequenceClassification)", path, info, key)
        self.model = model.eval()
        self.device = device or torch.device("cpu")
        self.model.to(self.device)
        self.batch_size, self.max_length = batch_size, max_length
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model.config.pad_token_id = self.tok.pad_token_id

    def with_batch_size(self, batch_size: int) -> RewardModel:
        """This model and tokenizer (not a copy of them) scoring `batch_size` texts per forward."""
        view = copy.copy(self)
        view.batch_size = batch_size
        return view

    def _texts(self, prompts: list[str], completions: list[str]) -> list[str]:
        if getattr(self.tok, "chat_template", None):
            return [self.tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                                 tokenize=False) for p, c in zip(prompts, completions)]
        return [p + c for p, c in zip(prompts, completions)]

    @torch.no_grad()
    def __call__(self, prompts: list[str], completions: list[str], answers=None) -> list[float]:
        texts = self._texts(prompts, completions)
        scores: list[float] = []
        for i in range(0, len(texts), self.batch_size):
            enc = self.tok(texts[i:i + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                           max_length=self.max_length, add_special_tokens=False).to(self.device)
            out = self.model(**enc)
            s = getattr(out, "score", None)
            s = out.logits[:, 0] if s is None else s.reshape(len(enc["input_ids"]), -1)[:, 0]
            scores += s.float().cpu().tolist()
        return scores
