"""A model named as users name it: `--model DIR`, or `--model owner/name[@revision]` (any value that is not a local
path) resolved through huggingface_hub's local cache, as vLLM and SGLang accept it.

The cache is the library's (`HF_HUB_CACHE`, else `HF_HOME/hub`, else ~/.cache/huggingface/hub) and so is its
reading: `snapshot_download(..., local_files_only=True)` follows `refs/<revision>` to `snapshots/<commit>/` (a
branch, a tag or a commit hash) without touching the network. Nothing is downloaded: where the files are not
cached, one line says so and how to download them.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from k2trt.errors import K2Error

# owner/name as the Hub spells repository ids, and an optional @revision
_REPO = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[\w./-]+))?")


class ModelNotCached(K2Error):
    pass


def is_local(value: str) -> bool:
    """A path that exists, or one under a directory that does (`build/tiny` before make-tiny ran is still local)."""
    p = Path(value)
    return p.exists() or p.is_absolute() or value.startswith(".") or (len(p.parts) > 1 and Path(p.parts[0]).is_dir())


def resolve_model(value: str, cache_dir: str | Path | None = None) -> Path:
    """The local directory of a --model value: the path itself, or the cached snapshot of owner/name[@revision]."""
    m = _REPO.fullmatch(value)
    if is_local(value) or m is None:
        return Path(value)
    repo, revision = m["repo"], m["revision"]
    from huggingface_hub import constants, snapshot_download

    try:
        return Path(snapshot_download(repo, revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # LocalEntryNotFoundError, or a cache entry the library cannot follow: not cached either way
        at = f"@{revision}" if revision else ""
        hint = f"hf download {repo}" + (f" --revision {revision}" if revision else "")
        raise ModelNotCached(f"{repo}{at} is not a local directory and is not in the Hugging Face cache "
                             f"({cache_dir or constants.HF_HUB_CACHE}); download it with `{hint}` "
                             f"(HF_HUB_CACHE picks the cache)") from None


def model_dir(value: str) -> Path:
    """An argparse type for --model: a directory, or owner/name[@revision] from the Hugging Face cache."""
    try:
        return resolve_model(value)
    except ModelNotCached as e:
        raise argparse.ArgumentTypeError(str(e)) from None


model_dir.__name__ = "model"
