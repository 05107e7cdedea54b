"""Checkpoints named by a Hugging Face repo id (`deepseek-ai/DeepSeek-V4-Flash`): resolved to a
local snapshot folder through `huggingface_hub`. The local cache first (no network when the
snapshot there is complete); with HF_HUB_OFFLINE=1 only the cache; otherwise config.json is
fetched and checked first (a repo that is not a DeepSeek-V4 checkpoint is refused before any
shard is downloaded), then the checkpoint's files, with huggingface_hub's progress bars.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from ..errors import CheckpointError, ConfigError, MissingFileError
from .checkpoint import INDEX_NAME, SINGLE_NAME

# owner/name as the Hub spells repo ids (letters, digits, '-', '_', '.'); a bare name is
# taken for a folder, never for a repo
REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
# what a released DSV4 repo holds that dsv4 reads (the repos also hold code and docs)
CHECKPOINT_FILES = ["config.json", "generation_config.json", "tokenizer.json",
                    "tokenizer_config.json", INDEX_NAME, "*.safetensors"]
MODEL_TYPE = "deepseek_v4"
DOWNLOAD_HOW = "hf download {repo} (huggingface-cli download {repo} with older clients)"


def looks_like_repo_id(ref: str) -> bool:
    """Whether `ref` (a --ckpt value that is not an existing path) reads as owner/name."""
    return bool(REPO_ID.fullmatch(ref)) and ".." not in ref and not ref.endswith(".")


def missing_files(folder: Path) -> list[str]:
    """The files a checkpoint folder still lacks: config.json, the index's shards (or the single
    model.safetensors); [] for a complete one. Cheap: names only, nothing is read but the index."""
    missing = [] if (folder / "config.json").is_file() else ["config.json"]
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError):
            return missing          # open_checkpoint names what is wrong with the index
        missing += sorted(f for f in shards if not (folder / f).is_file())
    elif not (folder / SINGLE_NAME).is_file():
        missing.append(f"{INDEX_NAME} or {SINGLE_NAME}")
    return missing


def check_dsv4_config(repo: str, config_path: Path) -> None:
    """CheckpointError when `repo`'s config.json is not a DeepSeek-V4 one (by model_type where it
    has one, else by ModelConfig's checks)."""
    from .config import ModelConfig
    try:
        d = json.loads(Path(config_path).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{repo}: its config.json is not valid JSON ({e}); not a "
                              f"DeepSeek-V4 checkpoint") from None
    kind = d.get("model_type") if isinstance(d, dict) else None
    if kind is not None and kind != MODEL_TYPE:
        raise CheckpointError(f"{repo} is not a DeepSeek-V4 checkpoint: its config.json says "
                              f"model_type = {kind!r} (dsv4 runs {MODEL_TYPE!r} checkpoints such "
                              f"as deepseek-ai/DeepSeek-V4-Flash); pass a DeepSeek-V4 repo or "
                              f"folder as --ckpt")
    try:
        ModelConfig.from_dict(d, source=f"{repo}: config.json")
    except ConfigError as e:
        raise CheckpointError(f"{repo} is not a DeepSeek-V4 checkpoint dsv4 can run: {e}") \
            from None


def resolve_checkpoint(repo: str, log=None) -> Path:
    """The local folder of the checkpoint in Hugging Face repo `repo` (owner/name), downloaded
    into the Hugging Face cache (HF_HOME / HF_HUB_CACHE) when it is not complete there and
    HF_HUB_OFFLINE is off. Errors (CheckpointError subclasses) say how to get it.
    log: where one-line notes go (default: stderr)."""
    say = log or (lambda msg: print(f"[dsv4] {msg}", file=sys.stderr, flush=True))
    try:
        import huggingface_hub  # noqa: F401
    except ImportError:
        raise MissingFileError(f"--ckpt {repo}: no such folder, and reading a Hugging Face repo "
                               f"id needs the huggingface_hub package: pip install "
                               f"huggingface_hub (or pass the checkpoint folder)") from None
    from huggingface_hub import constants, hf_hub_download, snapshot_download
    from huggingface_hub import utils as hf     # the client's errors, under this name in 0.23-2.x
    cache, offline = constants.HF_HUB_CACHE, constants.HF_HUB_OFFLINE
    how = DOWNLOAD_HOW.format(repo=repo)
    cached = None
    try:
        cached = Path(snapshot_download(repo, local_files_only=True,
                                        allow_patterns=CHECKPOINT_FILES))
    except hf.HFValidationError as e:
        raise MissingFileError(f"--ckpt {repo}: no such folder, and not a valid Hugging Face "
                               f"repo id ({e})") from None
    except hf.LocalEntryNotFoundError:
        pass
    if cached is not None:
        if (cached / "config.json").is_file():
            check_dsv4_config(repo, cached / "config.json")
        if not missing_files(cached):
            return cached
        if offline:
            missing = missing_files(cached)
            raise MissingFileError(f"--ckpt {repo}: the Hugging Face cache ({cache}) holds only "
                                   f"part of it ({len(missing)} file(s) missing: "
                                   f"{', '.join(missing[:5])}) and HF_HUB_OFFLINE=1 forbids a "
                                   f"download: unset HF_HUB_OFFLINE, or run {how}")
    elif offline:
        raise MissingFileError(f"--ckpt {repo}: no such folder, and not in the Hugging Face cache "
                               f"({cache}); HF_HUB_OFFLINE=1 forbids a download: run {how} where "
                               f"the network is reachable (same HF_HOME), or unset "
                               f"HF_HUB_OFFLINE, or pass the checkpoint folder")
    endpoint = constants.ENDPOINT
    try:
        config = hf_hub_download(repo, "config.json")
        check_dsv4_config(repo, Path(config))
        say(f"{repo}: downloading the checkpoint into the Hugging Face cache ({cache}); "
            f"files already there are kept")
        folder = Path(snapshot_download(repo, allow_patterns=CHECKPOINT_FILES))
    except hf.GatedRepoError:
        raise CheckpointError(f"--ckpt {repo}: the repo is gated; accept its terms on "
                              f"{endpoint}/{repo} and log in (hf auth login, or set HF_TOKEN)") \
            from None
    except hf.RepositoryNotFoundError:
        raise MissingFileError(f"--ckpt {repo}: no such folder, and no such model repo on "
                               f"{endpoint} (or it is private: log in with hf auth login or set "
                               f"HF_TOKEN)") from None
    except hf.RevisionNotFoundError as e:
        raise MissingFileError(f"--ckpt {repo}: {e}") from None
    except hf.LocalEntryNotFoundError:     # what the client raises when the Hub cannot be reached
        raise MissingFileError(f"--ckpt {repo}: could not reach {endpoint} to download it, and it "
                               f"is not in the Hugging Face cache ({cache}): check the network "
                               f"(or HF_ENDPOINT / the proxy variables), or run {how} elsewhere "
                               f"and copy the cache, or pass the checkpoint folder") from None
    except hf.EntryNotFoundError:
        raise CheckpointError(f"{repo} is not a DeepSeek-V4 checkpoint: it has no config.json; "
                              f"pass a DeepSeek-V4 repo or folder as --ckpt") from None
    except hf.HfHubHTTPError as e:
        raise CheckpointError(f"--ckpt {repo}: the download failed ({e}); try again, or run "
                              f"{how}") from None
    missing = missing_files(folder)
    if missing:
        raise MissingFileError(f"--ckpt {repo}: the repo lacks {', '.join(missing[:5])}; not a "
                               f"complete checkpoint in the released format")
    return folder
