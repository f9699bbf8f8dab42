"""UserError: a mistake the user can fix (bad config, bad data). The CLI prints it as one line, exit 2."""


class UserError(Exception):
    """Raised for bad input; the message must name the problem (and file:line for data)."""


class RunFailed(Exception):
    """Raised when a run cannot continue (NaN loss, sampler timeout); the run dir is marked incomplete."""
