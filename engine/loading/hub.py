"""Hugging Face hub ids as a model: `owner/name` or `owner/name@revision` (a branch, tag or commit).

Where the files come from, in this order:
1. a snapshot already in tokenmill's model cache (`cache_root()/models/hub`, the hub's own cache layout), or in the
   machine's Hugging Face cache (`hf_hub_cache()`: HF_HUB_CACHE, HF_HOME, ...; what `hf download` fills);
2. unless HF_HUB_OFFLINE is set, a download through `huggingface_hub.snapshot_download` into tokenmill's model
   cache, of the files a model needs (HUB_PATTERNS: configs, tokenizer, safetensors weights; a GGUF-only repo's one
   .gguf file), never the rest of the repo (.bin / .pth duplicates, `original/` checkpoints, other GGUF quants).
   The endpoint is HF_ENDPOINT (a mirror, or a test's server) and the token HF_TOKEN, read when the model is
   resolved. One process per machine downloads while the others wait on a file lock (`<owner>--<name>.lock`), as
   for models at s3:// URLs (engine.loading.model_files.fetch_model); huggingface_hub writes each file under a
   temporary name and links the snapshot once it is whole, so a cut download is resumed, never half-used.
"""

from __future__ import annotations

import fnmatch
import os
import re

from engine.loading.model_kinds import FOLDER_CONFIG_FILES
from engine.text.tokenizer import cache_root

# HF hub ids (huggingface_hub.utils.validate_repo_id): "owner/name", letters, digits, "-", "_", "."; at most 96; a
# revision after "@".
_HUB_ID = re.compile(r"([A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*)(?:@([A-Za-z0-9][A-Za-z0-9_./-]*))?")
#: The files of a hub repo a model needs (fnmatch patterns, "*" crossing "/"), for a folder of safetensors.
HUB_PATTERNS = ("*.json", "*.safetensors", "tokenizer.model", "*.tiktoken", "*.jinja", "merges.txt", "vocab.txt")
#: Never downloaded: the original checkpoints some repos keep beside the HF ones.
HUB_IGNORED = ("original/*",)
HUB_DIR = "hub"
_FALSE = ("", "0", "false", "no", "off")


def parse_hub_id(model: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) of a model shaped `owner/name[@revision]`, else None."""
    m = _HUB_ID.fullmatch(model)
    if m is None or len(m.group(1)) > 96 or ".." in model:
        return None
    return m.group(1), m.group(2)


def is_hub_id(model: str) -> bool:
    """True when `model` is shaped like a Hugging Face hub id (`owner/name[@revision]`) and no local path of that
    name exists (a local path always wins)."""
    return parse_hub_id(model) is not None and not os.path.exists(model)


def hf_hub_cache() -> str:
    """The Hugging Face hub cache folder, read from the environment now (as huggingface_hub.constants reads it at
    import): $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE, else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub,
    else ~/.cache/huggingface/hub."""
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "huggingface")
    hub = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return os.path.expandvars(os.path.expanduser(hub))


def hub_offline() -> bool:
    """True when HF_HUB_OFFLINE is set (to anything but 0/false/no/off): hub ids come from local caches only."""
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() not in _FALSE


def hub_model_path(model: str) -> str:
    """Local path of hub model `model` (`owner/name[@revision]`; module docstring for where it comes from).

    Returns the snapshot folder, or its one GGUF file when the snapshot holds no model config but exactly one
    `.gguf` (a GGUF-only repo). Raises FileNotFoundError (one line: the id, the caches searched and, offline or when
    the download failed, why and how to fill a cache), PermissionError (a private or gated repo without an accepted
    HF_TOKEN), ValueError (a GGUF-only repo of several files).
    """
    from filelock import FileLock

    parsed = parse_hub_id(model)
    if parsed is None:
        raise ValueError(f"{model!r} is not a Hugging Face hub id (owner/name or owner/name@revision)")
    repo_id, revision = parsed
    ours = cache_root() / "models" / HUB_DIR
    for cache in (str(ours), hf_hub_cache()):
        if (path := _cached(repo_id, revision, cache)) is not None:
            return _model_entry(path, model)
    if hub_offline():
        raise _not_found(model, ours, "HF_HUB_OFFLINE is set, so nothing is downloaded")
    ours.mkdir(parents=True, exist_ok=True)
    with FileLock(str(ours / f"{repo_id.replace('/', '--')}.lock")):
        if (path := _cached(repo_id, revision, str(ours))) is None:  # another process may have downloaded it
            path = _download(model, repo_id, revision, str(ours))
    return _model_entry(path, model)


def _cached(repo_id: str, revision: str | None, cache: str) -> str | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:  # the patterns of a download (a GGUF-only repo's one .gguf too): the snapshot is whole without the rest
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True,
                                 allow_patterns=[*HUB_PATTERNS, "*.gguf"], ignore_patterns=list(HUB_IGNORED))
    except (LocalEntryNotFoundError, HFValidationError, OSError):
        return None


def _download(model: str, repo_id: str, revision: str | None, cache: str) -> str:
    """snapshot_download of the files a model needs (HUB_PATTERNS; a GGUF-only repo's .gguf) into `cache`."""
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    endpoint, token = os.environ.get("HF_ENDPOINT") or None, os.environ.get("HF_TOKEN") or None
    where = endpoint or "https://huggingface.co"
    try:
        files = HfApi(endpoint=endpoint, token=token).list_repo_files(repo_id, revision=revision)
        patterns = list(HUB_PATTERNS)
        if not any(f in FOLDER_CONFIG_FILES for f in files):
            ggufs = sorted(f for f in files if f.endswith(".gguf"))
            if len(ggufs) > 1:
                raise ValueError(f"hub model {model!r} holds no config.json but {len(ggufs)} GGUF files "
                                 f"({', '.join(ggufs[:4])}{', ...' if len(ggufs) > 4 else ''}); download the one you "
                                 f"want (`hf download {repo_id} FILE.gguf`) and pass its path")
            patterns += ggufs
        wanted = [f for f in files if any(fnmatch.fnmatch(f, p) for p in patterns)
                  and not any(fnmatch.fnmatch(f, p) for p in HUB_IGNORED)]
        if not wanted:
            raise ValueError(f"hub model {model!r} holds none of the files tokenmill reads ({', '.join(HUB_PATTERNS)}"
                             f" or one .gguf): {', '.join(sorted(files)[:6])}")
        return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=wanted,
                                 ignore_patterns=list(HUB_IGNORED), endpoint=endpoint, token=token)
    except RevisionNotFoundError:
        raise FileNotFoundError(f"hub model {repo_id!r} has no revision {revision!r} at {where}; give a branch, tag "
                                "or commit it has") from None
    except HfHubHTTPError as e:  # RepositoryNotFoundError and GatedRepoError among them
        status = getattr(e.response, "status_code", None)
        if isinstance(e, GatedRepoError) or status in (401, 403):
            raise PermissionError(f"hub model {repo_id!r} at {where} refused the download (HTTP {status}): it is "
                                  "private or gated; accept its terms on the hub and set HF_TOKEN to a token that "
                                  f"may read it (HF_TOKEN is {'set' if token else 'unset'})") from None
        if isinstance(e, RepositoryNotFoundError):
            raise _not_found(model, cache, f"{where} has no such repo") from None
        raise _not_found(model, cache, f"downloading it from {where} failed ({e.__class__.__name__}: "
                                       f"{str(e).splitlines()[0]})") from None
    except OSError as e:  # httpx's connection errors, a full disk
        raise _not_found(model, cache, f"downloading it from {where} failed ({e.__class__.__name__}: {e})") from None


def _not_found(model: str, ours: object, why: str) -> FileNotFoundError:
    repo_id = model.split("@")[0]
    return FileNotFoundError(
        f"model {model!r} is not a local path and not in the Hugging Face cache {hf_hub_cache()} (HF_HOME="
        f"{os.environ.get('HF_HOME', 'unset')}) or tokenmill's {ours}; {why}: set HF_ENDPOINT / HF_TOKEN and unset "
        f"HF_HUB_OFFLINE to download it, run `hf download {repo_id}` where the workers' HF_HOME points, copy the "
        "model folder to S3 and pass its URL, or give a local path")


def _model_entry(path: str, model: str) -> str:
    """The snapshot folder, or its one .gguf file when it holds no model config but exactly one."""
    if not any(os.path.isfile(os.path.join(path, f)) for f in FOLDER_CONFIG_FILES):
        ggufs = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
        if len(ggufs) == 1:
            return os.path.join(path, ggufs[0])
    return path
