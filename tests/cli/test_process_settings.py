"""The CLI's process-wide settings reach torch: they are in the environment when torch is first imported, since
torch reads them once, at its first allocation."""
import json
import os
import subprocess
import sys

# records THP_MEM_ALLOC_ENABLE at the moment anything imports torch, then imports the CLI as the console script does
PROBE = """
import json, os, sys
seen = {}
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" and "at_torch" not in seen:
            seen["at_torch"] = os.environ.get("THP_MEM_ALLOC_ENABLE")
        return None
sys.meta_path.insert(0, Probe())
import humanline_cli.cli.main  # noqa: F401
import torch  # noqa: F401  (the probe fires here if the CLI itself imports torch lazily)
print(json.dumps(seen))
"""


def _probe(env_value: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if env_value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = env_value
    out = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_huge_pages_are_requested_before_torch_is_imported():
    assert _probe(None) == {"at_torch": "1"}


def test_the_users_setting_wins():
    assert _probe("0") == {"at_torch": "0"}
