"""Samplers: one interface (generate token ids + text + per-token log-probs; push weights)."""
