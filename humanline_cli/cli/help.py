"""`humanline train --help`: the groups a user picks from, read from conf/ (the schema/* groups Hydra also lists
are the structured configs behind each option, never chosen). The project's own studies (experiments and their
named regimes) are introduced in one line each that points at docs/results.md, not listed one by one. conf/train.yaml's
hydra.help.template calls this through the `humanline_groups` resolver."""
from __future__ import annotations

from importlib.resources import files

# experiments a user runs: the paper's settings; the others are the project's own laptop and SmolLM2 studies
USER_EXPERIMENTS = "paper_"
STUDIES = "humanline_cli/docs/results.md"


def _options(group) -> list[str]:
    return sorted(f.name.removesuffix(".yaml") for f in group.iterdir() if f.name.endswith(".yaml"))


def groups_help() -> str:
    """One line per group of conf/: `group: option, ...`; experiment and regime summarised."""
    lines = []
    for group in sorted((d for d in files("conf").iterdir() if d.is_dir()), key=lambda d: d.name):
        name, options = group.name, _options(group)
        if name == "hydra" or name.startswith(("_", ".")) or not options:
            continue
        if name == "experiment":
            mine = [o for o in options if o.startswith(USER_EXPERIMENTS)]
            rest = [o for o in options if o not in mine]
            lines.append(f"experiment: {', '.join(mine)}; and {len(rest)} studies of the project's own "
                         f"({', '.join(sorted({o.split('_')[0] + '_*' for o in rest}))}): {STUDIES}")
        elif name == "regime":
            lines.append(f"regime: {len(options)} named regimes of those studies (e.g. offline, online, stale16, hl): "
                         f"{STUDIES}, conf/regime/")
        else:
            lines.append(f"{name}: {', '.join(options)}")
    return "\n".join(lines)


def register() -> None:
    from omegaconf import OmegaConf

    OmegaConf.register_new_resolver("humanline_groups", groups_help, replace=True)
