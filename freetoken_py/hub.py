"""`--model ORG/NAME[@REV]`: models by hub id, through `huggingface_hub` (its cache, HF_HOME,
HF_TOKEN, HF_ENDPOINT, HF_HUB_OFFLINE, its progress bars and in-transfer resumption).

Only what freetoken loads is fetched: the config, generation and quantisation configs, the
tokenizer and chat-template files, the safetensors index and the shards it names (else every
top-level `*.safetensors`). Never pickle weights (`.bin`, `.pt`, `.pth`), never remote code.
A path that exists wins over a hub id of the same spelling. The disk is checked before the
first weight byte is fetched; `huggingface_hub` moves a file into the cache only once it is
complete, and a snapshot is used only when every file it needs is there.

`remote_checkpoint` reads a repo's safetensors headers with HTTP range reads (config files
only are downloaded) for `freetoken probe --model ORG/NAME`: the same tensor list the local
header reader gives, so the probe's plan is the local one's.
"""
from __future__ import annotations

import json
import re
import shutil
import struct
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Union

from freetoken_py.errors import FreetokenError, ModelLoadError, first_line

# the files a checkpoint loads from, besides its weights (top level of the repo only)
CONFIG_FILES = ("config.json", "generation_config.json", "hf_quant_config.json", "tokenizer.json",
                "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "chat_template.json",
                "model.safetensors.index.json")
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<rev>[\w./-]+))?$")
_HEADER_PROBE = 100_000          # first range read: most safetensors headers fit (huggingface_hub's choice)
_MAX_HEADER = 100 * 1024 * 1024  # models.checkpoint's limit


@dataclass(frozen=True)
class HubRef:
    repo: str
    revision: str = "main"
    flag: str = field(default="--model", compare=False)   # the option it came from, for error messages

    def __str__(self) -> str:
        return self.repo if self.revision == "main" else f"{self.repo}@{self.revision}"


def parse_spec(spec: Union[str, Path], flag: str = "--model") -> Union[Path, HubRef]:
    """A local path when one exists (it wins), else a hub id, else a one-line error."""
    path = Path(spec).expanduser()
    if path.exists():
        return path
    m = _HUB_ID.match(str(spec))
    if m is None:
        raise FreetokenError(f"{flag} {spec}: no such directory, and not a hub id (ORG/NAME or ORG/NAME@REVISION)")
    return HubRef(m["repo"], m["rev"] or "main", flag)


def resolve_model(spec: Union[str, Path], flag: str = "--model") -> Path:
    """The checkpoint directory for `spec`: the path itself, or the hub snapshot (downloaded if needed)."""
    ref = parse_spec(spec, flag)
    if isinstance(ref, Path):
        if not ref.is_dir():
            raise FreetokenError(f"{flag} {ref}: not a directory (expected a Hugging Face checkpoint folder)")
        return ref
    return fetch(ref)


def fetch(ref: HubRef) -> Path:
    from huggingface_hub import constants

    with hub_errors(ref):
        if constants.is_offline_mode():
            return _cached(ref, "HF_HUB_OFFLINE is set")
        try:
            listing, _ = _listing(ref)
        except _Unreachable as exc:
            return _cached(ref, f"the hub at {constants.ENDPOINT} cannot be reached ({exc})")
        if "config.json" not in listing:
            raise FreetokenError(f"{ref.flag} {ref}: the repo has no config.json (not a transformers checkpoint)")
        folder = _download(ref, [f for f in CONFIG_FILES if f in listing])
        weights = weight_files(ref, listing, folder)
        need = sum(listing[f] or 0 for f in weights if not (folder / f).exists())
        check_disk(ref, need)
        folder = _download(ref, [f for f in CONFIG_FILES if f in listing] + weights)
        return _complete(ref, folder)


class _Unreachable(Exception):
    pass


def _listing(ref: HubRef) -> tuple[dict[str, Optional[int]], str]:
    """{file: size} of the repo at the revision, and its commit."""
    import httpx2
    from huggingface_hub import HfApi

    try:
        info = HfApi().model_info(ref.repo, revision=ref.revision, files_metadata=True)
    except (httpx2.ConnectError, httpx2.TimeoutException) as exc:
        raise _Unreachable(type(exc).__name__) from None
    return {s.rfilename: s.size for s in info.siblings or ()}, info.sha


def _download(ref: HubRef, files: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(ref.repo, revision=ref.revision, allow_patterns=[_glob_escape(f) for f in files]))


def _glob_escape(name: str) -> str:
    """allow_patterns are fnmatch patterns: match this name exactly."""
    return re.sub(r"([\[\]*?])", r"[\1]", name)


def _cached(ref: HubRef, why: str) -> Path:
    """The cached snapshot of `ref` when it is complete, else a one-line error saying why not."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        folder = Path(snapshot_download(ref.repo, revision=ref.revision, local_files_only=True,
                                        allow_patterns=["config.json"]))
    except LocalEntryNotFoundError:
        raise FreetokenError(f"{ref.flag} {ref}: not in the hub cache ({constants.HF_HUB_CACHE}) and {why}") from None
    return _complete(ref, folder, why)


def _complete(ref: HubRef, folder: Path, why: str = "") -> Path:
    """`folder` if it holds a whole checkpoint: every file that loads, by the repo's listing as
    huggingface_hub cached it (else the index's shards, or one safetensors file); a snapshot an
    interrupted download left partial is never used."""
    listing = _cached_listing(ref)
    if listing is not None:
        missing = [f for f in CONFIG_FILES if f in listing and not (folder / f).exists()]
        if INDEX not in missing:      # the index names the shards
            missing += [f for f in weight_files(ref, listing, folder) if not (folder / f).exists()]
    else:
        missing = [f for f in ("config.json",) if not (folder / f).exists()]
        if (folder / INDEX).exists():
            missing += sorted(f for f in _index_shards(ref, folder) if not (folder / f).exists())
        elif not any(folder.glob("*.safetensors")):
            missing.append("*.safetensors")
    if missing:
        more = f" and {why}" if why else ""
        raise FreetokenError(f"{ref.flag} {ref}: the cached snapshot {folder} lacks {', '.join(missing[:3])}"
                             f"{' ...' if len(missing) > 3 else ''}{more}; run again online to complete it")
    return folder


def _cached_listing(ref: HubRef) -> Optional[dict[str, Optional[int]]]:
    """The repo's file listing as the hub cache recorded it for this revision (no request), if any."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return {f.path: f.size for f in get_cached_repo_tree(ref.repo, revision=ref.revision)}
    except (CachedRepoTreeNotFoundError, OSError, ValueError):   # none recorded, or another tool's cache
        return None


def _index_shards(ref: HubRef, folder: Path) -> set[str]:
    try:
        weight_map = json.loads((folder / INDEX).read_text(encoding="utf-8"))["weight_map"]
        return set(weight_map.values())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise FreetokenError(f"{ref.flag} {ref}: {INDEX} is not a valid index (no 'weight_map')") from None


def weight_files(ref: HubRef, listing: dict[str, Optional[int]], folder: Path) -> list[str]:
    """The shards that load: those the index names, else every top-level safetensors file."""
    top = [f for f in listing if "/" not in f]
    if INDEX in listing:
        shards = sorted(_index_shards(ref, folder))
        absent = [s for s in shards if s not in listing]
        if absent:
            raise FreetokenError(f"{ref.flag} {ref}: {INDEX} names {absent[0]}, which the repo does not have")
        return shards
    shards = sorted(f for f in top if f.endswith(".safetensors"))
    if shards:
        return shards
    pickles = sorted(f for f in top if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise FreetokenError(f"{ref.flag} {ref}: the repo has only pickle weights ({pickles[0]}); freetoken loads "
                             "safetensors only (pickle can run code when loaded)")
    raise FreetokenError(f"{ref.flag} {ref}: the repo has no safetensors weights")


def check_disk(ref: HubRef, need: int) -> None:
    where, free = disk_free()
    if need > free:
        raise FreetokenError(f"{ref.flag} {ref}: the download needs {need / 2**30:.2f} GiB, {where} has "
                             f"{free / 2**30:.2f} GiB free (set HF_HOME to a larger disk)")


def disk_free() -> tuple[Path, int]:
    from huggingface_hub import constants

    where = Path(constants.HF_HUB_CACHE)
    return where, shutil.disk_usage(_existing(where)).free


def _existing(path: Path) -> Path:
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


@contextmanager
def hub_errors(ref: HubRef) -> Iterator[None]:
    """huggingface_hub's exceptions as one line naming the repo (the CLI exits 2 on them)."""
    import httpx2
    from huggingface_hub import constants
    from huggingface_hub import errors as e

    try:
        yield
    except e.GatedRepoError:
        raise FreetokenError(f"{ref.flag} {ref}: the repo is gated: accept its terms on the model page, "
                             "then set HF_TOKEN") from None
    except e.RevisionNotFoundError:
        raise FreetokenError(f"{ref.flag} {ref}: no revision {ref.revision!r} in {ref.repo}") from None
    except e.RepositoryNotFoundError:
        raise FreetokenError(f"{ref.flag} {ref}: no such model at {constants.ENDPOINT} (check the spelling; "
                             "no such directory here either; a private repo needs HF_TOKEN)") from None
    except e.RemoteEntryNotFoundError as exc:
        raise FreetokenError(f"{ref.flag} {ref}: a file the repo listed is missing ({first_line(exc)})") from None
    except e.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else "?"
        hint = " (a gated or private repo: set HF_TOKEN)" if status in (401, 403) else ""
        raise FreetokenError(f"{ref.flag} {ref}: the hub answered HTTP {status}{hint}") from None
    except e.LocalEntryNotFoundError as exc:
        raise FreetokenError(f"{ref.flag} {ref}: cannot download and not in the cache ({first_line(exc)})") from None
    except (httpx2.ConnectError, httpx2.TimeoutException, httpx2.RemoteProtocolError) as exc:
        raise FreetokenError(f"{ref.flag} {ref}: the hub at {constants.ENDPOINT} cannot be reached "
                             f"({type(exc).__name__})") from None
    except OSError as exc:     # a full disk mid-download, a consistency check, a read-only cache
        raise FreetokenError(f"{ref.flag} {ref}: download failed: {first_line(exc)}") from None


# --- headers only: `freetoken probe --model ORG/NAME` ---------------------------------------

@dataclass(frozen=True)
class RemoteCheckpoint:
    ref: HubRef
    commit: str
    folder: Path                 # the snapshot folder: config files only, unless downloaded before
    tensors: dict                # name -> models.checkpoint.TensorInfo (file = folder / shard)
    download_bytes: int          # what `run --model` would still fetch (files not in the cache)
    total_bytes: int             # every file it loads, cached or not
    cache_dir: Path
    disk_free_bytes: int


def remote_checkpoint(ref: HubRef) -> RemoteCheckpoint:
    """config files + every shard's safetensors header (range reads), nothing else."""
    with hub_errors(ref):
        listing, commit = _listing_or_raise(ref)
        configs = [f for f in CONFIG_FILES if f in listing]
        folder = _download(ref, configs)
        weights = weight_files(ref, listing, folder)
        tensors: dict = {}
        for shard in weights:
            for name, info in _remote_header(ref, commit, shard, listing[shard], folder).items():
                if name in tensors:
                    raise ModelLoadError(f"{folder / shard}: tensor '{name}' also appears in {tensors[name].file.name}")
                tensors[name] = info
        files = configs + weights
        where, free = disk_free()
        return RemoteCheckpoint(ref, commit, folder, tensors,
                                sum(listing[f] or 0 for f in files if not (folder / f).exists()),
                                sum(listing[f] or 0 for f in files), where, free)


def _listing_or_raise(ref: HubRef) -> tuple[dict[str, Optional[int]], str]:
    from huggingface_hub import constants

    if constants.is_offline_mode():
        raise FreetokenError(f"{ref.flag} {ref}: probing a hub id reads the repo's headers online; "
                             "HF_HUB_OFFLINE is set")
    try:
        return _listing(ref)
    except _Unreachable as exc:
        raise FreetokenError(f"{ref.flag} {ref}: the hub at {constants.ENDPOINT} cannot be reached ({exc})") from None


def _remote_header(ref: HubRef, commit: str, shard: str, size: Optional[int], folder: Path) -> dict:
    """One shard's header through HTTP range reads, parsed and checked as a local file's is."""
    from freetoken_py.models.checkpoint import _tensor_info   # the local reader's own per-tensor checks

    path = folder / shard
    head = _read_range(ref, commit, shard, 0, _HEADER_PROBE)
    if len(head) < 8:
        raise ModelLoadError(f"{path}: truncated safetensors file (no header)")
    (n,) = struct.unpack("<Q", head[:8])
    if n > _MAX_HEADER or (size is not None and n > size - 8):
        raise ModelLoadError(f"{path}: truncated or corrupt safetensors header (header says {n} bytes, file has {size})")
    raw = head[8:8 + n] if len(head) >= 8 + n else _read_range(ref, commit, shard, 8, n)
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise ModelLoadError(f"{path}: corrupt safetensors header (not JSON)") from None
    data_bytes = (size if size is not None else 1 << 62) - 8 - n
    return {name: _tensor_info(path, name, meta, data_bytes)
            for name, meta in header.items() if name != "__metadata__"}


def _read_range(ref: HubRef, commit: str, shard: str, start: int, length: int) -> bytes:
    """bytes [start, start + length) of a file; read as a stream and closed after `length` bytes,
    so a server that ignores Range still sends no more than that."""
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status

    url = hf_hub_url(ref.repo, shard, revision=commit, endpoint=constants.ENDPOINT)
    headers = {**build_hf_headers(), "Range": f"bytes={start}-{start + length - 1}", "Accept-Encoding": "identity"}
    out = bytearray()
    with get_session().stream("GET", url, headers=headers, follow_redirects=True) as r:
        hf_raise_for_status(r)
        skip = start if r.status_code == 200 else 0     # Range ignored: the body starts at byte 0
        for chunk in r.iter_bytes():
            if skip:
                cut = min(skip, len(chunk))
                chunk, skip = chunk[cut:], skip - cut
            out += chunk
            if len(out) >= length:
                break
    return bytes(out[:length])
