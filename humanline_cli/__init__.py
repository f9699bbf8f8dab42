"""humanline: DPO / KTO / GRPO alignment, offline, online and humanline, from one Hydra CLI."""

__version__ = "0.1.0"
