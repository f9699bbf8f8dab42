"""How a config key is declared: its default and its help in one dataclass field (`knob`), shared by the schema
(humanline_cli/schema.py) and the objectives' own configs (core/objectives/), which core keeps so that it never
imports the schema."""
from __future__ import annotations

import dataclasses
import math

from humanline_cli.errors import UserError


def knob(default=dataclasses.MISSING, help: str = "", *, factory=dataclasses.MISSING, hidden: bool = False):
    """One config key: its default (or default factory) and its help, in the field's metadata, as TRL's configs
    declare each knob (`field(default=..., metadata={"help": ...})`). docs/config.md's key tables are generated from
    these (humanline_cli/docs_gen.py); OmegaConf ignores the metadata. Without a default the key is required
    (OmegaConf reads a field without one as missing, `???`), so core needs no import of omegaconf. `hidden`: a key
    for checking the tool itself (backend.profile), left out of docs/config.md."""
    return dataclasses.field(default=default, default_factory=factory, metadata={"help": help, "hidden": hidden})


def positive(value, key: str):
    """`value` when it is a finite number > 0, else a UserError naming the config key."""
    if value is None or isinstance(value, bool) or not value > 0 or (isinstance(value, float) and not math.isfinite(value)):
        raise UserError(f"config key '{key}' must be > 0, got {value}")
    return value
