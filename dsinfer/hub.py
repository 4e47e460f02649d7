"""Models named as Hugging Face repositories: ``dsinfer serve deepseek-ai/DeepSeek-V4-Flash``, ``LLM("ORG/NAME")``.

A model argument that is an existing directory is used as it is. Otherwise an ``ORG/NAME`` repository id is
fetched by ``huggingface_hub.snapshot_download`` (its progress bars, its cache: ``HF_HOME`` / ``HF_HUB_CACHE``
or ``--download-dir``, a ``--revision`` branch, tag or commit), or found in that cache without any network
access when ``HF_HUB_OFFLINE=1``, as vLLM and SGLang resolve model names. Only the files a checkpoint needs are
downloaded (configs, tokenizer, safetensors).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

#: The files of a repository a checkpoint directory needs; READMEs, images and other formats are skipped.
CHECKPOINT_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer*"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TRUTHY = {"1", "true", "yes", "on"}


class ModelNotFoundError(ValueError):
    """The model argument is neither a directory nor a repository the hub (or its cache) has."""


def is_repo_id(model: str) -> bool:
    """``ORG/NAME`` (one slash, hub-legal characters), and not a path that exists on disk."""
    return bool(_REPO_ID.match(model)) and not Path(model).expanduser().exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in _TRUTHY


def resolve_model_dir(model: str | Path, revision: str | None = None, download_dir: str | Path | None = None) -> Path:
    """The local checkpoint directory of ``model``: the directory itself, or the repository's snapshot."""
    path = Path(model).expanduser()
    text = str(model)
    if path.is_dir() or not is_repo_id(text):
        return path  # a directory, or a path the checkpoint loader reports missing (naming the file it looked for)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        snapshot = snapshot_download(
            text,
            revision=revision,
            cache_dir=str(download_dir) if download_dir is not None else None,
            allow_patterns=CHECKPOINT_PATTERNS,
            local_files_only=offline(),
        )
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model {text!r}: not in the Hugging Face cache{' (HF_HUB_OFFLINE is set)' if offline() else ''}: "
            f"{_first_line(exc)}"
        ) from None
    except (HfHubHTTPError, OSError) as exc:
        raise ModelNotFoundError(f"model {text!r}: {_first_line(exc)}") from None
    return Path(snapshot)


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
