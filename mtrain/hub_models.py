"""A hub id as a model path (`model.hf_path=Qwen/Qwen3-1.7B`), resolved the way transformers resolves it.

huggingface_hub's own cache and download (`snapshot_download`): the files land in its cache
(`HF_HUB_CACHE`, default `~/.cache/huggingface/hub`, `models--ORG--NAME/snapshots/REV/`), a second run reads them
from there, `HF_HUB_OFFLINE=1` never touches the network, and `HF_TOKEN` opens gated repositories. Only the files a
run reads are fetched: config, tokenizer, chat template and safetensors weights (no `.bin`/`.pt`/GGUF copies).

An existing local folder always wins: the id form is tried only for a value that names no folder on this machine.
The resolved folder replaces the id in the run's config before anything else reads it (`mtrain train
--nproc-per-node N` resolves once in the launching process and hands every rank the same folder).
"""
from __future__ import annotations

import os
import re
from pathlib import Path

# ORG/NAME as the hub spells repository ids (no leading dot or slash, exactly one slash)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


class HubModelError(ValueError):
    pass


def looks_like_hub_id(value: str) -> bool:
    return bool(value) and not Path(value).exists() and bool(_HUB_ID.match(value)) and ".." not in value


def resolve_hub_id(repo_id: str, report=print) -> str:
    """The local snapshot folder of `repo_id`: from huggingface_hub's cache, downloaded into it when missing (and not
    offline). `report` says when a download starts (it can take minutes; the cache serves later runs)."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError)
    try:
        cached = snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS, local_files_only=True)
    except (LocalEntryNotFoundError, FileNotFoundError, OSError):
        cached = None
    if constants.HF_HUB_OFFLINE:
        if cached is None:
            raise HubModelError(f"{repo_id} is not a local folder and not in the Hugging Face cache "
                                f"({constants.HF_HUB_CACHE}), and HF_HUB_OFFLINE=1 forbids a download: run once "
                                f"online, or give the model's folder")
        return cached
    if cached is None and report is not None:
        report(f"mtrain: downloading {repo_id} from the Hugging Face Hub into {constants.HF_HUB_CACHE} "
               f"(config, tokenizer, safetensors; first use only, later runs read the cache)")
    try:
        return snapshot_download(repo_id, allow_patterns=ALLOW_PATTERNS)
    except GatedRepoError:
        raise HubModelError(f"{repo_id} is gated on the Hugging Face Hub: accept its licence on the model page and "
                            f"set HF_TOKEN (or `hf auth login`)") from None
    except RepositoryNotFoundError:
        raise HubModelError(f"{repo_id} is neither a folder here nor a model on the Hugging Face Hub (a private one "
                            f"needs HF_TOKEN)") from None
    except LocalEntryNotFoundError:
        raise HubModelError(f"{repo_id} is not a local folder, not in the Hugging Face cache "
                            f"({constants.HF_HUB_CACHE}), and the hub cannot be reached") from None
    except (HfHubHTTPError, OSError) as e:
        raise HubModelError(f"{repo_id}: download from the Hugging Face Hub failed: {e}") from None


def rank0_report(msg: str) -> None:
    if os.environ.get("RANK", "0") == "0":
        print(msg, flush=True)
