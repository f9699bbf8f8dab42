"""UserError: a mistake the user can fix (bad config, bad data). The CLI prints it as one line, exit 2."""


class UserError(Exception):
    """Raised for bad input; the message must name the problem (and file:line for data)."""


class RunFailed(Exception):
    """Raised when a run cannot continue (NaN loss, sampler timeout); the run dir is marked incomplete."""


class Preempted(RunFailed):
    """SIGTERM (SLURM preemption or time limit) stopped the run at a step boundary, after a checkpoint
    when checkpointing is configured; the CLI prints one line and exits 143 (128 + SIGTERM)."""
