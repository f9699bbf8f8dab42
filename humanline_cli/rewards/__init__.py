"""Rewards: labellers (score training samples) and judges (evaluation) share one interface:
scorer(prompts: list[str], completions: list[str], answers: list | None) -> list[float]."""
