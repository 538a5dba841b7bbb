"""Hugging Face Hub locations (SPEC §7): ``hf:REPO[@REVISION]``, ``REPO`` an ``OWNER/NAME`` (or a
bare ``NAME``) repository id: a dataset repository where a data path is expected, a model
repository holding a ``tokenizer.json`` where a tokenizer is.

Files are read from the local hub cache in the Hub's own layout (``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ``$XDG_CACHE_HOME/huggingface/hub``, else ``~/.cache/huggingface/hub``,
read at each call): ``datasets--OWNER--NAME/snapshots/<commit>/...`` (``models--...`` for a
model), ``refs/<branch>`` naming the commit of a branch. With ``HF_HUB_OFFLINE`` set nothing but
that cache is read; otherwise ``huggingface_hub`` downloads what the cache lacks into it. Every
failure is a one-line ``ValueError`` naming what is missing and how to fetch it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

HUB_PREFIX = "hf:"
_TRUE = {"1", "ON", "YES", "TRUE"}


@dataclass(frozen=True)
class HubRepo:
    """A repository of the Hub at a revision (``None``: its default branch)."""

    repo_id: str
    revision: str | None
    repo_type: str
    """``"dataset"`` or ``"model"``."""

    @property
    def spec(self) -> str:
        return HUB_PREFIX + self.repo_id + (f"@{self.revision}" if self.revision else "")

    def location(self) -> dict[str, str]:
        """Where the repository is, not what it holds: its id and the revision as asked for (a
        branch keeps its key when it moves on; the content hash then rebuilds the cache)."""
        return {"hub": self.repo_id, "revision": self.revision or "main"}

    def fetch_hint(self, pattern: str | None = None) -> str:
        """The ``hf download`` command that puts the files into the local cache."""
        words = ["hf download", self.repo_id]
        if self.repo_type != "model":
            words.append(f"--repo-type {self.repo_type}")
        if self.revision:
            words.append(f"--revision {self.revision}")
        if pattern:
            words.append(f"--include '{pattern}'" if "*" in pattern else pattern)
        return " ".join(words)


def is_hub(value: object) -> bool:
    """Whether ``value`` is an ``hf:`` location."""
    return isinstance(value, str) and value.startswith(HUB_PREFIX)


def parse_hub(value: str, repo_type: str) -> HubRepo:
    """``hf:OWNER/NAME[@REVISION]`` (or ``hf:NAME``) -> a ``HubRepo`` of ``repo_type``."""
    repo_id, at, revision = value[len(HUB_PREFIX):].partition("@")
    parts = repo_id.split("/")
    if (not value.startswith(HUB_PREFIX) or len(parts) > 2 or not all(parts)
            or (at and not revision) or any(c.isspace() for c in value)):
        raise ValueError(f"{value!r} is not a Hub location: expected hf:OWNER/NAME or hf:NAME, "
                         f"optionally followed by @REVISION")
    return HubRepo(repo_id, revision or None, repo_type)


def hub_cache_dir() -> Path:
    """The local hub cache the environment names now (as ``huggingface_hub`` reads it)."""
    env = os.environ
    folder = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if not folder:
        home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or "~/.cache",
                                                  "huggingface")
        folder = os.path.join(home, "hub")
    return Path(os.path.expandvars(os.path.expanduser(folder)))


def hub_offline() -> bool:
    """Whether ``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) forbids reaching the Hub."""
    return any((os.environ.get(name) or "").upper() in _TRUE
               for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _hub() -> Any:
    try:
        import huggingface_hub
    except ImportError:
        raise ValueError("hf: locations need huggingface_hub: pip install 'ecp-lm[hub]'") \
            from None
    return huggingface_hub


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


def _failure(repo: HubRepo, what: str, err: Exception, offline: bool, pattern: str | None) -> str:
    """The one-line reason why ``repo`` could not be read, with the way to fetch it."""
    from huggingface_hub import errors

    fetch = f"fetch it with `{repo.fetch_hint(pattern)}`"
    if isinstance(err, errors.RevisionNotFoundError):
        return f"{what} {repo.spec}: the Hub has no revision {repo.revision!r} of {repo.repo_id}"
    if isinstance(err, errors.HFValidationError):
        return f"{what} {repo.spec}: not a valid repository id ({_one_line(err)})"
    if isinstance(err, errors.RepositoryNotFoundError):
        return (f"{what} {repo.spec}: no {repo.repo_type} repository {repo.repo_id!r} on the Hub "
                f"(or it is private or gated: log in with `hf auth login`)")
    if isinstance(err, errors.LocalEntryNotFoundError):
        if offline:
            return (f"{what} {repo.spec}: not in the local Hugging Face cache {hub_cache_dir()} "
                    f"and HF_HUB_OFFLINE is set; {fetch}, or unset HF_HUB_OFFLINE")
        return (f"{what} {repo.spec}: not in the local Hugging Face cache {hub_cache_dir()} and "
                f"the Hub could not be reached; {fetch} when online")
    if isinstance(err, errors.EntryNotFoundError):  # on the Hub, not in the repository
        return f"{what} {repo.spec}: the repository has no {pattern}"
    return f"{what} {repo.spec}: {type(err).__name__}: {_one_line(err)}"


def snapshot(repo: HubRepo, pattern: str, what: str) -> Path:
    """The snapshot folder of ``repo`` in the local cache, holding the files that match
    ``pattern`` (downloaded first unless offline). ``what`` names the caller in errors."""
    hub, offline = _hub(), hub_offline()
    try:
        folder = hub.snapshot_download(repo.repo_id, repo_type=repo.repo_type,
                                       revision=repo.revision, allow_patterns=[pattern],
                                       cache_dir=hub_cache_dir(), local_files_only=offline)
    except Exception as err:  # huggingface_hub raises many kinds; each is one line here
        raise ValueError(_failure(repo, what, err, offline, pattern)) from None
    return Path(folder)


def cached_snapshot(repo: HubRepo, pattern: str) -> Path | None:
    """The snapshot folder of ``repo`` in the local cache if it holds the files that match
    ``pattern`` (as far as the cache can tell), else ``None``; never downloads."""
    try:
        return Path(_hub().snapshot_download(repo.repo_id, repo_type=repo.repo_type,
                                             revision=repo.revision, allow_patterns=[pattern],
                                             cache_dir=hub_cache_dir(), local_files_only=True))
    except Exception:  # not cached, or cached without these files
        return None


def hub_file(repo: HubRepo, filename: str, what: str) -> Path:
    """``filename`` of ``repo`` from the local cache (downloaded first unless offline)."""
    hub, offline = _hub(), hub_offline()
    try:
        path = hub.hf_hub_download(repo.repo_id, filename, repo_type=repo.repo_type,
                                   revision=repo.revision, cache_dir=hub_cache_dir(),
                                   local_files_only=offline)
    except Exception as err:  # as in snapshot()
        raise ValueError(_failure(repo, what, err, offline, filename)) from None
    return Path(path)


def missing_files(repo: HubRepo, folder: Path, pattern: str, what: str) -> ValueError:
    """The error for a cached snapshot ``folder`` of ``repo`` that lacks the files of
    ``pattern`` (a download of other files of the repository)."""
    return ValueError(f"{what} {repo.spec}: the cached snapshot {folder} holds no {pattern}; "
                      f"fetch it with `{repo.fetch_hint(pattern)}`")
