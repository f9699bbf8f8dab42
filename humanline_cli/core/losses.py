"""The objectives' losses as pure functions of token log-ratios, masks and floats, in one import; each lives with
its objective (core/objectives/).

Shapes: token_* tensors are (N, T) (the log-prob axis, T = seq_len - 1), masks are float (N, T)
with 1 on completion tokens, seq_* tensors are (N,). Token log-ratios arrive already passed
through the humanline transform (identity when off). Each function returns (loss, metrics) where
metrics are detached scalars for logging.
"""
from __future__ import annotations

from humanline_cli.core.objectives.dpo import dpo_loss
from humanline_cli.core.objectives.grpo import TOKEN_MEAN_AGGREGATIONS, grpo_loss
from humanline_cli.core.objectives.kto import kto_loss, kto_reference_point

__all__ = ["TOKEN_MEAN_AGGREGATIONS", "dpo_loss", "grpo_loss", "kto_loss", "kto_reference_point"]
