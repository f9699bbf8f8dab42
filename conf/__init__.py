"""Hydra config tree of `humanline train`; importing it registers the typed schemas."""
import humanline_cli.schema  # noqa: F401
