"""Load tokenizer, policy and reference (safetensors only; remote code only when opted in).

Every load failure is a UserError of one line naming what to fix: the path, the corrupted weights
file, or the key to set when a model needs its own code (`load_error`, shared with the reward model).
"""
from __future__ import annotations

import glob
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as hf_logging

from humanline_cli.errors import UserError

# the file world/packaged.py writes last into a model it converted (a packaged model's folder in the cache)
CONVERTED_MARK = "packaged.json"


def _where(path: str) -> str:
    return path if os.path.exists(path) else f"{path} (not a local dir; hub download needs network)"


def needs_remote_code(e: BaseException) -> bool:
    """transformers' refusal to run a model's own code (config.json `auto_map`) without opt-in."""
    return "trust_remote_code" in str(e) and "custom code" in str(e)


# Names transformers 5 removed from its modelling modules that published remote code still imports. ArmoRM's
# modeling_custom.py (RLHFlow/ArmoRM-Llama3-8B-v0.1, the paper's labeller and judge) imports LLAMA_INPUTS_DOCSTRING
# only to decorate its forward's docstring, so an empty docstring restores it exactly; any other name is left
# missing, and the ImportError is one line (load_error).
REMOVED_NAMES = {"transformers.models.llama.modeling_llama": {"LLAMA_INPUTS_DOCSTRING": ""}}


def provide_removed_names() -> None:
    """Put back REMOVED_NAMES (each only where missing) before a model's own code is imported."""
    import importlib

    for module, names in REMOVED_NAMES.items():
        mod = importlib.import_module(module)
        for name, value in names.items():
            if not hasattr(mod, name):
                setattr(mod, name, value)


def corrupted_weights(path: str) -> str | None:
    """The first *.safetensors file in a local model dir whose header safetensors cannot read."""
    from safetensors import safe_open

    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as e:
            return f"{file} ({str(e).splitlines()[0] if str(e) else type(e).__name__})"
    return None


def pickle_only(path: str) -> list[str]:
    """The pickle weight files (*.bin, *.pt, *.pth, *.ckpt) of a local model dir that has no *.safetensors."""
    if glob.glob(os.path.join(path, "*.safetensors")):
        return []
    return sorted(os.path.basename(f) for ext in ("bin", "pt", "pth", "ckpt")
                  for f in glob.glob(os.path.join(path, f"*.{ext}")))


def load_error(what: str, path: str, e: BaseException, trust_key: str) -> UserError:
    """One line for a failed from_pretrained: which key to set for remote code, which weights file
    is corrupted, else the library's first line."""
    if needs_remote_code(e):
        key = trust_key if "=" in trust_key else f"{trust_key}=true"
        return UserError(f"{what} {path} needs its own code to load (config.json auto_map); if you trust it, "
                         f"set {key}")
    if isinstance(e, ImportError):  # the model's own code imports what this transformers no longer has
        import transformers

        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return UserError(f"cannot load {what} {path}: its own code (trust_remote_code) does not import under "
                         f"transformers {transformers.__version__}: {first}")
    bad = corrupted_weights(path) if os.path.isdir(path) else None
    if bad:
        again = (f"; remove {path} and the next run converts it again"  # a converted packaged model: ours to redo
                 if os.path.isfile(os.path.join(path, CONVERTED_MARK)) else "")
        return UserError(f"cannot load {what} from {path}: corrupted or truncated weights file {bad}{again}")
    pickled = pickle_only(path) if os.path.isdir(path) else []
    if pickled:
        return UserError(f"cannot load {what} from {path}: its weights are pickle files only ({', '.join(pickled)}), "
                         f"which are never loaded (unpickling can run code); convert them to safetensors, e.g. "
                         f"model.save_pretrained(dir, safe_serialization=True) where you trust the files")
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return UserError(f"cannot load {what} from {_where(path)}: {first}")


def own_code(path: str, auto_class: str) -> str | None:
    """What config.json's `auto_map` names for `auto_class` (a model's own code), or None (also where the config
    cannot be read: the load then says why in one line)."""
    from transformers import PretrainedConfig

    try:
        config, _ = PretrainedConfig.get_config_dict(path)
    except Exception:  # OSError, ValueError, a corrupted json: the load reports it
        return None
    named = (config.get("auto_map") or {}).get(auto_class)
    return str(named) if named else None


def refuse_own_code_unless_trusted(what: str, path: str, auto_class: str, trust_remote_code: bool,
                                   trust_key: str) -> None:
    """A checkpoint whose config.json names its own code for `auto_class` while remote code is off is refused
    before any weight loads. Where its model_type is one transformers knows (ArmoRM says `llama`), transformers
    would quietly build the library's class instead (a LlamaForSequenceClassification lacking ArmoRM's heads),
    and the load could at best fail on missing weights without naming the key that fixes it."""
    named = None if trust_remote_code else own_code(path, auto_class)
    if named:
        key = trust_key if "=" in trust_key else f"{trust_key}=true"
        raise UserError(f"{what} {path} needs its own code to load (config.json auto_map); if you trust it, set {key}")


def check_loaded(what: str, path: str, info: dict, key: str) -> None:
    """Refuse weights the checkpoint did not hold: transformers initialises a missing tensor at random
    and only prints a load report, so a causal LM given as a reward model would score with a random
    `score` head (every win rate 0.5, exit 0). `info` is from_pretrained's output_loading_info."""
    missing = sorted(info.get("missing_keys") or ())
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info.get("mismatched_keys") or ())
    if not (missing or mismatched):
        return
    names = missing or mismatched
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    hint = ("; a causal LM given where a reward model is expected? its score head was never trained"
            if any(n.split(".")[0] in ("score", "classifier") for n in names) else "")
    state = "lacks weights" if missing else "has weights of another shape than those"
    raise UserError(f"{key}={path}: the checkpoint {state} the {what} needs: {shown} (they would start "
                    f"random{hint})")


def quiet_load(fn, *args, **kwargs):
    """from_pretrained without transformers' multi-line load report (check_loaded says it in one line)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        return fn(*args, **kwargs)
    finally:
        hf_logging.set_verbosity(level)


def load_tokenizer(path: str, trust_remote_code: bool = False, trust_key: str = "model.trust_remote_code"):
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # OSError, ValueError, tokenizers' own errors on a corrupted tokenizer.json
        raise load_error("tokenizer", path, e, trust_key) from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.eos_token_id is None:
        raise UserError(f"tokenizer at {path} has no eos token; completions could never end")
    return tok


def load_policy(path: str, device: torch.device, trust_remote_code: bool = False,
                trust_key: str = "model.trust_remote_code", key: str = "model.name_or_path",
                dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """fp32 master weights on `device` (autocast handles bf16 compute); weights via safetensors.
    Every weight must come from the checkpoint (check_loaded); `key` names the path in that error.
    `dtype` float64: backend.precision=fp64 (Backend.weights_dtype)."""
    from safetensors import SafetensorError

    hf_logging.disable_progress_bar()  # our own progress display is enough
    try:
        model, info = quiet_load(AutoModelForCausalLM.from_pretrained,
                                 path, use_safetensors=True, dtype=dtype, trust_remote_code=trust_remote_code,
                                 output_loading_info=True)
    except (OSError, ValueError, SafetensorError) as e:
        raise load_error("model", path, e, trust_key) from None
    try:
        check_loaded("policy (a causal LM)", path, info, key)
    except UserError as e:  # the library's class of its model_type, where the checkpoint names its own
        if trust_remote_code or not own_code(path, "AutoModelForCausalLM"):
            raise
        set_key = trust_key if "=" in trust_key else f"{trust_key}=true"
        raise UserError(f"{e}; its config.json auto_map names its own code: if you trust it, set {set_key}") from None
    model.config.use_cache = False
    return model.to(device).train()


def tied_copies(model: torch.nn.Module) -> set[str]:
    """The parameter names a transformers model ties to another one (a tied lm_head: the input embedding),
    kept only where the live model's two names really are one Parameter. A checkpoint holds such a
    weight once, under its source name; from_pretrained (and vLLM's loader) re-tie the other on load."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    params = dict(model.named_parameters(remove_duplicate=False))
    return {k for k, src in tied.items() if k in params and params.get(src) is params[k]}
