"""The Hugging Face Hub and local paths: a file or a model from a local path, a cached copy or a download; an
offline machine gets one line naming the flag to use; SentEval's senteval.tar is unpacked once."""
from __future__ import annotations

import os
import socket
import tarfile
from pathlib import Path
from urllib.parse import urlparse

import torch

from plumbing import UsageError, backbones

SIMCSE_DATA_REPO = "princeton-nlp/datasets-for-simcse"
LOCAL_FLAGS = "--model_name_or_path, --train_file and --senteval_dir"


def hub_reachable(timeout: float = 3.0) -> bool:
    """A fast DNS + TCP check, so an offline machine fails at once instead of after minutes of retries."""
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    if any(os.environ.get(v) for v in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return True  # behind a proxy a direct connection says nothing; let huggingface_hub try
    from huggingface_hub import constants
    url = urlparse(constants.ENDPOINT)
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False

def hub_file(repo: str, filename: str, flag: str, local: str = "file", offline: str = LOCAL_FLAGS) -> str:
    """Path of `filename` in the HF dataset repo `repo`: cached copy, else a download, else a one-line error
    naming `flag`, which takes a local `local` ("file" or "folder"), and `offline`, the script's local-path flags."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    try:
        return hf_hub_download(repo, filename, repo_type="dataset", local_files_only=True)
    except Exception:
        pass
    if not hub_reachable():
        raise UsageError(f"cannot reach the Hugging Face Hub to download {filename} and no cached copy exists; "
                         f"pass a local {local} with {flag} (offline runs need {offline})")
    try:
        return hf_hub_download(repo, filename, repo_type="dataset")
    except Exception as err:
        raise UsageError(f"downloading {filename} from {repo} failed ({type(err).__name__}); "
                         f"pass a local {local} with {flag}") from None

def looks_local(name: str) -> bool:
    """A path, not a hub id ("owner/name"): starts with . / or ~, has two or more slashes, or its parent exists."""
    parent = Path(name).expanduser().parent
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or (parent != Path(".") and parent.is_dir())

# What a local model folder needs besides config.json: weights, and a tokenizer's vocabulary (transformers 5 builds an
# empty tokenizer, every word [UNK], from a folder that has none of these)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "sentencepiece.bpe.model", "spm.model",
                   "tokenizer.model")


def check_model_folder(path: Path, flag: str) -> None:
    """A local model folder's files, each read before transformers loads it: config.json, the weights (each
    safetensors file's header against its size: a truncated copy is found here) and the tokenizer's vocabulary; one
    line naming the file that is missing or damaged."""
    import json
    shown = f"{flag} {path}"
    if not (path / "config.json").is_file():
        raise UsageError(f"{shown} is a folder but not a model (it has no config.json)")
    try:
        json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise UsageError(f"{shown}: config.json cannot be read ({type(err).__name__}); copy the model again") from None
    if not any((path / name).is_file() for name in WEIGHT_FILES):
        raise UsageError(f"{shown} has no weights ({' or '.join(WEIGHT_FILES[::2])}); copy the model again")
    from safetensors import safe_open
    for weights in sorted(path.glob("*.safetensors")):
        try:
            with safe_open(str(weights), "pt"):
                pass
        except Exception as err:  # safetensors' own error class: a truncated or damaged file
            reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:120]
            raise UsageError(f"{shown}: {weights.name} is truncated or damaged ({reason}); copy it again") from None
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        raise UsageError(f"{shown} has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); save the "
                         "tokenizer beside the model")


def check_local_model(name_or_path: str, flag: str = "--model_name_or_path") -> bool:
    """Whether `name_or_path` is a local model folder, its files checked (check_model_folder); one line for a path
    that does not exist or is a file. A Hub id: False (a cached copy or a download, when the model is loaded)."""
    path = Path(name_or_path).expanduser()
    if not path.exists() and looks_local(name_or_path):  # e.g. runs/simcse/best before the run wrote it
        raise UsageError(f"{flag} {name_or_path}: no such folder")
    if not path.exists():
        return False
    if not path.is_dir():
        raise UsageError(f"{flag} {name_or_path} is a file; give the model's directory")
    check_model_folder(path, flag)
    return True


def load_pretrained(name_or_path: str, attn_implementation: str | None = None, auto_class=None,
                    flag: str = "--model_name_or_path", offline: str = LOCAL_FLAGS):
    """(tokenizer, model) with AutoModel (or `auto_class`, e.g. AutoModelForMaskedLM): a local directory, a cached
    hub copy, else a download.

    Offline and not cached is one clear error naming `flag`, the option that gave the model, and `offline`, the
    script's local-path flags; so is a local folder with a missing or damaged file, and a model that is not a
    bidirectional encoder (read from its config, before its weights).
    """
    from transformers import AutoConfig, AutoModel, AutoTokenizer
    from transformers.utils import logging as tf_logging
    from huggingface_hub.utils import logging as hub_logging
    hub_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()
    kwargs = {"attn_implementation": attn_implementation} if attn_implementation else {}

    def load(local_files_only):
        config = AutoConfig.from_pretrained(name_or_path, local_files_only=local_files_only)
        backbones.refuse_non_encoder(config, name_or_path, flag)
        tokenizer = AutoTokenizer.from_pretrained(name_or_path, local_files_only=local_files_only)
        # transformers 5 keeps a checkpoint's own dtype; fp32 here: evaluation in fp32, fp32 master weights
        return tokenizer, (auto_class or AutoModel).from_pretrained(
            name_or_path, config=config, local_files_only=local_files_only, dtype=torch.float32, **kwargs)

    try:
        if check_local_model(name_or_path, flag):
            return load(local_files_only=True)
        verbosity = tf_logging.get_verbosity()
        tf_logging.set_verbosity_error()
        try:
            return load(local_files_only=True)  # a cached copy needs no network
        except OSError:
            pass
        finally:
            tf_logging.set_verbosity(verbosity)
        if not hub_reachable():
            raise UsageError(f"cannot reach the Hugging Face Hub to download '{name_or_path}' and no cached copy "
                             f"exists; pass a local model directory with {flag} "
                             f"(offline runs need {offline})")
        return load(local_files_only=False)
    except (OSError, ValueError) as err:
        if isinstance(err, UsageError):
            raise
        reason = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise UsageError(f"cannot load model '{name_or_path}' ({reason}); check {flag}") from None

def local_config(name_or_path: str):
    """The model's config from a local folder or the hub cache, without the network; None if there
    is none (the model itself is loaded, or refused in one line, later)."""
    from transformers import AutoConfig
    from transformers.utils import logging as tf_logging
    verbosity = tf_logging.get_verbosity()
    tf_logging.set_verbosity_error()
    try:
        return AutoConfig.from_pretrained(name_or_path, local_files_only=True)
    except Exception:
        return None
    finally:
        tf_logging.set_verbosity(verbosity)

def _find_data_root(folder: Path, marker: str = "STS") -> Path | None:
    """The folder that holds `marker`/ (SentEval's data/downstream), searched a few levels down."""
    for candidate in [folder, *sorted(folder.glob("*")), *sorted(folder.glob("*/*")), *sorted(folder.glob("*/*/*"))]:
        if (candidate / marker).is_dir():
            return candidate
    return None

def senteval_folder(senteval_dir: str | None, offline: str = LOCAL_FLAGS) -> Path:
    """SentEval's data folder: the given one (or the folder holding STS/ a few levels down), else senteval.tar
    from the HF dataset repo, downloaded with huggingface_hub and unpacked once next to the cached file."""
    if senteval_dir is not None:
        folder = Path(senteval_dir).expanduser()
        if not folder.exists():
            raise UsageError(f"--senteval_dir {senteval_dir}: no such folder")
        root = _find_data_root(folder) if folder.is_dir() else None
        if root is None:
            raise UsageError(f"--senteval_dir {senteval_dir}: no SentEval STS/ folder found there")
        return root
    tar_path = Path(hub_file(SIMCSE_DATA_REPO, "senteval.tar", "--senteval_dir", local="folder", offline=offline))
    target = tar_path.parent / "senteval_unpacked"
    if _find_data_root(target) is None:
        with tarfile.open(tar_path) as tar:
            try:
                tar.extractall(target, filter="data")
            except TypeError:  # Python releases before the extraction filters
                tar.extractall(target)
    root = _find_data_root(target)
    if root is None:
        raise UsageError(f"{tar_path} has no STS/ folder; pass --senteval_dir")
    return root
