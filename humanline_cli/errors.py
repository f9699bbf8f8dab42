"""Every exception the program raises on purpose, the one-line form of an error (credentials in it masked by their
shape, `mask_secrets`), and the ways out of a command (`fail`, `ignore_ctrl_c`).

How each one ends a `humanline train` job (exit code, failed.json, message) is one table, in
train/failures.py `outcome`."""
from __future__ import annotations

import argparse
import math
import re
import signal
import sys
import threading

MASK = "***"
# a URL's password (scheme://user:PASSWORD@host): the user name stays, to tell which account
_URL_PASSWORD = re.compile(r"(?P<head>\b[A-Za-z][A-Za-z0-9+.\-]*://[^/\s:@]*:)[^/\s@]+@")
# tokens whose shape says what they are, wherever they stand (a URL's userinfo, an override, an error message):
# GitHub (ghp_/gho_/ghu_/ghs_/ghr_, github_pat_), OpenAI and Anthropic (sk-), Hugging Face (hf_), Slack (xox?-),
# AWS access key ids (AKIA/ASIA + 16). A random token mixes upper and lower case; a file or model name that happens
# to start the same way (sk-learn-runs-2024-final.jsonl) rarely does, and is left as it is (_token)
_TOKEN = re.compile(r"(?<![A-Za-z0-9])(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,}"
                    r"|sk-[A-Za-z0-9_\-]{20,}|hf_[A-Za-z0-9]{20,}|xox[abprs]-[A-Za-z0-9\-]{10,}"
                    r"|(?:AKIA|ASIA)[0-9A-Z]{16})(?![A-Za-z0-9])")


class UserError(Exception):
    """Raised for bad input; the message must name the problem (and file:line for data). Exit 2."""


class RunFailed(Exception):
    """Raised when a run cannot continue (NaN loss, sampler timeout); the run dir is marked incomplete. Exit 2."""


class Preempted(RunFailed):
    """SIGTERM (SLURM preemption or time limit) stopped the run at a step boundary, after a checkpoint
    when checkpointing is configured; the CLI prints one line and exits 143 (128 + SIGTERM)."""


class PeerFailed(RunFailed):
    """This rank stops because another one failed (agreed by a collective): that rank names the cause."""


class RankCrashed(RuntimeError):
    """A rank of a distributed job hit a bug (not bad input): the CLI lets it through, exit 1."""


class RunDirBusy(UserError):
    """Another live job holds the run dir's lock."""


class RunDirConflict(UserError):
    """The run dir holds a run made with another config (or one that cannot be checked)."""


class Terminated(BaseException):
    """SIGTERM raised where the main thread is (as Ctrl-C's KeyboardInterrupt is), by a command that has nothing to
    checkpoint (`raise_terminated` as its handler): a BaseException, so no `except Exception` swallows it and the
    command ends with its own line."""


def raise_terminated(signum, frame):
    raise Terminated()


def exit_on_sigterm(signum, frame):
    """SIGTERM where no command has its own handler (starting up, importing, preparing the run dir): one line and
    exit 143, as SIGTERM's default would end it, at once (nothing half-done is waited for)."""
    import os

    os.write(2, b"humanline: stopped by SIGTERM outside training (nothing to checkpoint); rerun the same command\n")
    os._exit(143)


class Interrupted(KeyboardInterrupt):
    """Ctrl-C, carrying where it landed (`at step N`, `after training`), so the CLI reports it from the
    exception itself. A KeyboardInterrupt and still caught as one."""

    def __init__(self, where: str):
        super().__init__(where)
        self.where = where


def mask_secrets(text: str) -> str:
    """`text` with every credential recognisable by its shape masked: a URL's password and tokens with a known
    prefix. What a key's NAME marks as secret is masked by the writers of configs (train/tracking.scrub), which
    call this for every other string."""
    if not isinstance(text, str) or len(text) < 10:
        return text
    return _TOKEN.sub(_token, _URL_PASSWORD.sub(lambda m: m["head"] + MASK + "@", text))


def _token(m: re.Match) -> str:
    t = m[0]
    mixed = any(c.isupper() for c in t[4:]) and any(c.islower() for c in t[4:])
    return MASK if t.startswith(("AKIA", "ASIA")) or mixed else t


def one_line(e: BaseException, secret: str | None = None, limit: int | None = None) -> str:
    """An error's message on one line (its lines joined), or its type's name when it has none; `secret`
    (a key a server may echo back, 6 characters or more) and credentials shaped like one (mask_secrets) masked;
    at most `limit` characters."""
    text = " ".join(ln.strip() for ln in str(e).splitlines() if ln.strip()) or type(e).__name__
    if secret and len(secret) >= 6:
        text = text.replace(secret, MASK)
    text = mask_secrets(text)
    return text[:limit] if limit is not None else text


def cannot_write(path, e: BaseException) -> RunFailed:
    """A failed write (a full disk, a quota, a read-only mount) as one line naming the file."""
    return RunFailed(f"cannot write {path}: {getattr(e, 'strerror', None) or e}")


def fail(msg: str, code: int = 2):
    """The CLI's way out for a mistake the user can fix: one stderr line with the prefix, exit 2."""
    print(f"humanline: error: {msg}", file=sys.stderr)
    sys.exit(code)


class ArgumentParser(argparse.ArgumentParser):
    """argparse for the commands it parses (report, eval): a mistake ends as every other user mistake does, in one
    `humanline: error:` line naming the command, exit 2, not argparse's usage block."""

    def error(self, message: str):
        fail(f"{self.prog.removeprefix('humanline ')}: {message} (--help shows the usage)")


def finite_float(low: float | None = None, high: float | None = None, positive: bool = False):
    """An argparse `type`: a finite float within [low, high] (positive: > 0); nan and inf are refused."""

    def parse(text: str) -> float:
        try:
            x = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(x) or (positive and not x > 0) or (low is not None and x < low) \
                or (high is not None and x > high):
            want = "a finite number > 0" if positive else f"a finite number in [{low:g}, {high:g}]"
            raise argparse.ArgumentTypeError(f"expected {want}, got {text!r}")
        return x

    return parse


def ignore_ctrl_c() -> None:
    """From here on this process ignores Ctrl-C (SIGINT), the one place that does: a command ending after the first
    Ctrl-C (a second one, such as the one torch's agent forwards to every rank, must not cut its last line or
    failed.json short), and the sampler child, whose parent handles Ctrl-C. Only the main thread may set a handler."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
