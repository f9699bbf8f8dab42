import signal

from humanline_cli.errors import exit_on_sigterm

# before the imports (torch, transformers, Hydra: seconds), so that a SIGTERM while they load, or anywhere no
# command's own handler (a run's checkpoint at the step boundary, sample, bench) is in place, ends with a line
signal.signal(signal.SIGTERM, exit_on_sigterm)

from humanline_cli.cli.main import main  # noqa: E402

main()
