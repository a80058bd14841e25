"""Models by name from the Hugging Face Hub: `gateway pull hf.co/<user>/<repo>[:<quant>]`.

A pull lists the repository's files (huggingface-hub, honouring HF_ENDPOINT and HF_TOKEN), picks
the GGUF of the asked quantisation (Q4_K_M when none is asked; every file of a split model),
downloads it into the standard Hugging Face cache (resuming a download that was cut off: the
library keeps the `.incomplete` part and asks for the rest with a Range request), checks each
file's size and SHA-256 against the Hub's, reads the GGUF's own metadata, and writes the model's
entry into the user registry (`models.d/`, see `user_models_dir`), which every command reads
beside models.yaml.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import yaml

from gateway.models.gguf_info import GGUFError, read_gguf
from gateway.settings import Settings

log = logging.getLogger(__name__)

# Tried in this order when a pull names no quantisation (Ollama and llama-server default to Q4_K_M).
DEFAULT_QUANTS = ("Q4_K_M", "Q4_K_S", "Q4_0", "Q4_1", "IQ4_XS", "IQ4_NL", "Q5_K_M", "Q5_K_S", "Q6_K", "Q8_0",
                  "Q3_K_M", "Q3_K_L", "Q2_K", "BF16", "F16", "F32")
# A pulled model's context unless `--context` says otherwise: models train for 128k tokens and more,
# and llama.cpp allocates the KV of the whole context up front (Ollama's default is 4096).
DEFAULT_PULL_CONTEXT = 8192
_QUANT = re.compile(r"(?<![A-Za-z0-9])((?:I?Q\d(?:_[A-Za-z0-9]+)*)|BF16|F16|F32|MXFP4|TQ\d_0)(?![A-Za-z0-9])",
                    re.IGNORECASE)
# A vision model's projector (`mmproj-*.gguf` beside the model), by precision: as llama-server's
# and Ollama's vision models ship it (F16 first).
PROJECTOR_PRECISIONS = ("F16", "BF16", "F32", "Q8_0")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


class PullError(RuntimeError):
    """A pull that cannot be done; the message says why and what would work."""


@dataclass(frozen=True)
class HubName:
    repo: str
    quant: str | None = None
    revision: str = "main"

    @property
    def canonical(self) -> str:
        """The id a pull registers: `hf.co/<user>/<repo>:<quant>` (Ollama's spelling)."""
        return f"hf.co/{self.repo}" + (f":{self.quant}" if self.quant else "")


def parse_name(name: str) -> HubName | None:
    """`hf.co/<user>/<repo>[:<quant>]`, `huggingface.co/...`, `https://huggingface.co/...` or
    `<user>/<repo>[:<quant>]`, with an optional `@<revision>` after the repo; None for a plain model
    id (one without a slash)."""
    s = name.strip()
    for prefix in ("https://", "http://"):
        s = s.removeprefix(prefix)
    for host in ("hf.co/", "huggingface.co/"):
        if s.startswith(host):
            s = s[len(host):]
            break
    else:
        if "/" not in s:
            return None
    repo, _, quant = s.partition(":")
    repo, _, revision = repo.partition("@")
    if not _REPO.match(repo):
        return None
    return HubName(repo, quant or None, revision or "main")


def quant_of(filename: str) -> str | None:
    """The quantisation a GGUF's file name (or folder) says, upper-cased: "Q4_K_M", "IQ4_XS", "F16"."""
    found = _QUANT.findall(_SHARD.sub(".gguf", filename))
    return found[-1].upper() if found else None


@dataclass(frozen=True)
class RemoteFile:
    path: str
    size: int | None
    sha256: str | None


@dataclass(frozen=True)
class Choice:
    quant: str
    files: tuple[RemoteFile, ...]  # one, or every shard of a split model in order

    @property
    def size(self) -> int:
        return sum(f.size or 0 for f in self.files)


def choose(files: list[RemoteFile], want: str | None, repo: str) -> Choice:
    """The GGUF (all its shards) of quantisation `want`, or the preferred one when `want` is None."""
    ggufs = [f for f in files if f.path.lower().endswith(".gguf") and "mmproj" not in f.path.lower()]
    if not ggufs:
        raise PullError(f"{repo} has no GGUF file (gateway pull serves GGUF repositories, such as the "
                        f"'-GGUF' repositories of bartowski, unsloth or the model's authors)")
    by_quant: dict[str, list[RemoteFile]] = {}
    for f in ggufs:
        q = quant_of(f.path) or Path(f.path).stem
        by_quant.setdefault(q.upper(), []).append(f)
    if want is None:
        q = next((q for q in DEFAULT_QUANTS if q in by_quant), None) or min(by_quant, key=lambda k: _total(by_quant[k]))
    else:
        q = want.upper()
        if q not in by_quant:
            raise PullError(f"{repo} has no {want} GGUF; it has: {', '.join(sorted(by_quant))}")
    chosen = by_quant[q]
    shards = [f for f in chosen if _SHARD.search(f.path)]
    if shards:
        # Several split models of one quantisation (rare) would need a name to tell them apart.
        first = min(shards, key=lambda f: f.path)
        prefix = _SHARD.sub("", first.path)
        parts = sorted((f for f in shards if _SHARD.sub("", f.path) == prefix), key=lambda f: f.path)
        count = int(_SHARD.search(first.path).group(2))  # type: ignore[union-attr]
        if len(parts) != count:
            raise PullError(f"{repo}: {first.path} is split in {count} files but the repository has {len(parts)}")
        return Choice(q, tuple(parts))
    if len(chosen) > 1:
        raise PullError(f"{repo} has several {q} GGUFs ({', '.join(f.path for f in chosen)}); "
                        "name one with hf.co/<user>/<repo>:<file stem>")
    return Choice(q, (chosen[0],))


def choose_projector(files: list[RemoteFile], named: str | None, repo: str) -> RemoteFile | None:
    """The repository's vision projector: the file `named`, else the first of PROJECTOR_PRECISIONS
    (else the smallest); None when it has none (a text model)."""
    found = [f for f in files if f.path.lower().endswith(".gguf") and "mmproj" in Path(f.path).name.lower()]
    if named:
        hit = next((f for f in found if named in (f.path, Path(f.path).name)), None)
        if hit is None:
            raise PullError(f"{repo} has no projector {named!r}; it has: {', '.join(f.path for f in found) or 'none'}")
        return hit
    if not found:
        return None
    ranked = sorted(found, key=lambda f: (_rank_of(quant_of(f.path)), f.size or 0, f.path))
    return ranked[0]


def _rank_of(quant: str | None) -> int:
    return PROJECTOR_PRECISIONS.index(quant) if quant in PROJECTOR_PRECISIONS else len(PROJECTOR_PRECISIONS)


def _total(files: list[RemoteFile]) -> int:
    return sum(f.size or 0 for f in files)


# --- the user registry -----------------------------------------------------------------


def user_models_dir() -> Path:
    """Where pulled models are registered: $GATEWAY_MODELS_DIR, else $XDG_DATA_HOME/llm-gateway/models.d
    (~/.local/share/llm-gateway/models.d)."""
    if d := Settings.read("models_dir"):
        return Path(d).expanduser()
    data = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data) / "llm-gateway" / "models.d"


def entry_file(model_id: str, directory: Path | None = None) -> Path:
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", model_id).strip("_")
    return (directory or user_models_dir()) / f"{slug}.yaml"


def write_entry(entry: dict[str, Any], directory: Path | None = None) -> Path:
    """Write one model's registry entry atomically (a concurrent reader sees the old file or the new)."""
    path = entry_file(entry["id"], directory)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}.{threading.get_ident()}")
    tmp.write_text("# Written by `gateway pull` (or Ollama's /api/create); `gateway rm` removes it with the files "
                   "it owns.\n"
                   + yaml.safe_dump(entry, sort_keys=False, allow_unicode=True, width=120))
    tmp.replace(path)
    return path


# --- progress ----------------------------------------------------------------------------


@dataclass
class PullProgress:
    """What a pull has done so far (the web page and Ollama's /api/pull stream show it)."""

    name: str
    status: str = "listing"  # listing | downloading | verifying | registering | done | failed
    total: int = 0
    completed: int = 0
    file: str = ""
    error: str = ""
    started: float = field(default_factory=time.time)
    model_id: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "total": self.total, "completed": self.completed,
                "file": self.file, "error": self.error, "model": self.model_id}


# --- pulling -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pulled:
    model_id: str
    entry: dict[str, Any]
    path: Path  # the (first) GGUF file
    registry_file: Path
    already: bool  # every file was in the cache and verified before


def list_files(name: HubName) -> tuple[str, list[RemoteFile]]:
    """(commit, files) of the repository at the name's revision."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        info = HfApi().model_info(name.repo, revision=name.revision, files_metadata=True)
    except GatedRepoError as exc:
        raise PullError(f"{name.repo} is gated: accept its terms on the Hub and set HF_TOKEN to a token of "
                        f"that account ({_first_line(exc)})") from exc
    except RevisionNotFoundError as exc:
        raise PullError(f"{name.repo} has no revision {name.revision!r}") from exc
    except RepositoryNotFoundError as exc:
        hint = "" if os.environ.get("HF_TOKEN") else " (a private repository needs HF_TOKEN)"
        raise PullError(f"no repository {name.repo} on the Hub{hint}") from exc
    except HfHubHTTPError as exc:
        raise PullError(f"the Hub answered {_first_line(exc)}") from exc
    except Exception as exc:  # noqa: BLE001 - network errors of every kind, said plainly
        raise PullError(f"cannot reach the Hub to list {name.repo}: {_first_line(exc)}") from exc
    files = [RemoteFile(s.rfilename, s.lfs.size if s.lfs else s.size, s.lfs.sha256 if s.lfs else None)
             for s in info.siblings or []]
    return str(info.sha or name.revision), files


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _verified(path: Path, want: RemoteFile) -> str | None:
    """Why `path` is not the file the Hub lists (None: it is)."""
    size = path.stat().st_size
    if want.size is not None and size != want.size:
        return f"{want.path} is {size} bytes, the Hub lists {want.size}"
    if want.sha256 and (got := sha256_of(path)) != want.sha256:
        return f"{want.path} has SHA-256 {got[:16]}…, the Hub lists {want.sha256[:16]}…"
    return None


def _discard(path: Path) -> None:
    """Remove a bad download: its snapshot link and the blob behind it."""
    try:
        blob = path.resolve()
        path.unlink(missing_ok=True)
        if blob != path:
            blob.unlink(missing_ok=True)
    except OSError as exc:
        log.warning("could not remove %s: %s", path, exc)


def pull(name: HubName, context: int | None = None, progress: PullProgress | None = None,
         notify: Callable[[], None] = lambda: None, directory: Path | None = None, mmproj: str | None = None) -> Pulled:
    """Download and register `name`, with the repository's vision projector when it has one (`mmproj`:
    the projector's file name, else by PROJECTOR_PRECISIONS). Blocking; safe to run twice at once
    (the Hub cache locks each file; the registry entry is replaced atomically)."""

    progress = progress or PullProgress(name.canonical)
    progress.status = "listing"
    notify()
    commit, files = list_files(name)
    choice = choose(files, name.quant, name.repo)
    projector = choose_projector(files, mmproj, name.repo)
    progress.total = choice.size + (projector.size or 0 if projector else 0)
    model_id = HubName(name.repo, choice.quant).canonical
    progress.model_id = model_id
    paths: list[Path] = []
    fresh = False
    for f in (*choice.files, *([projector] if projector else [])):
        done = sum(p.stat().st_size for p in paths)
        progress.status, progress.file = "downloading", f.path
        notify()
        got, downloaded = _fetch(name.repo, commit, f, progress, done, notify, directory)
        fresh = fresh or downloaded
        paths.append(got)
        progress.completed = done + got.stat().st_size
    if name.revision == "main":
        _write_ref(name.repo, "main", commit)
    progress.status = "registering"
    notify()
    try:
        info = read_gguf(paths[0])
    except GGUFError as exc:
        for p in paths:
            _discard(p)
        raise PullError(f"{name.repo}/{choice.files[0].path}: {exc}") from exc
    trained = info.context_length or 4096
    ctx = min(context or DEFAULT_PULL_CONTEXT, trained)
    aliases = [f"{name.repo}:{choice.quant}"]
    if name.quant is None:
        aliases += [f"hf.co/{name.repo}", name.repo]  # the name it was pulled by
    entry: dict[str, Any] = {
        "id": model_id,
        "description": f"{name.repo} {choice.quant} GGUF from the Hugging Face Hub",
        "aliases": aliases,
        "context_length": ctx,
        "formats": {"gguf": {"hf": {"repo": name.repo, "file": choice.files[0].path, "revision": commit,
                                    **({"parts": [f.path for f in choice.files[1:]]} if len(choice.files) > 1 else {})}}},
        "pulled": {
            "name": name.canonical, "quant": choice.quant, "size_bytes": choice.size,
            "parameters": info.parameters, "context_trained": trained, "architecture": info.arch,
            "chat_template": bool(info.chat_template),
            "sha256": {f.path: f.sha256 for f in (*choice.files, *([projector] if projector else [])) if f.sha256},
            "pulled_at": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }
    if projector is not None:
        entry["mmproj"] = {"hf": {"repo": name.repo, "file": projector.path, "revision": commit}}
        entry["description"] += f", with its vision projector {projector.path}"
    if info.chat_template is None:
        log.warning("%s has no chat template in its GGUF; chat requests will use llama.cpp's default", model_id)
    path = write_entry(entry, directory)
    progress.status = "done"
    progress.completed = progress.total
    notify()
    return Pulled(model_id, entry, paths[0], path, already=not fresh)


# --- downloading into the Hugging Face cache ------------------------------------------------
#
# huggingface-hub resumes a download only within one call (a dropped connection is retried with a
# Range request); a pull that is stopped (Ctrl-C, a crash, a reboot) starts again from zero. A pull
# here keeps its part file, `blobs/<sha256>.incomplete`, under the same lock huggingface-hub takes
# for that blob, and asks for the rest; the finished file goes where huggingface-hub puts it
# (blobs/<sha256>, linked from snapshots/<commit>/<path>), so other tools find it and it finds theirs.


def _repo_dir(repo: str) -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE) / f"models--{repo.replace('/', '--')}"


def _write_ref(repo: str, ref: str, commit: str) -> None:
    path = _repo_dir(repo) / "refs" / ref
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text() != commit:
            path.write_text(commit)
    except OSError as exc:
        log.warning("could not record %s of %s: %s", ref, repo, exc)


def _link(blob: Path, pointer: Path) -> None:
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.{threading.get_ident()}")
    try:
        tmp.symlink_to(os.path.relpath(blob, pointer.parent))
    except OSError:  # no symlinks (some Windows set-ups): a copy, as huggingface-hub does
        import shutil

        shutil.copyfile(blob, tmp)
    tmp.replace(pointer)


def _fetch(repo: str, commit: str, f: RemoteFile, progress: PullProgress, done: int, notify: Callable[[], None],
           directory: Path | None) -> tuple[Path, bool]:
    """The file in the cache, verified: (path, whether anything was downloaded)."""
    from filelock import FileLock

    if not f.sha256:
        return _fetch_plain(repo, commit, f), True
    repo_dir = _repo_dir(repo)
    blob = repo_dir / "blobs" / f.sha256
    pointer = repo_dir / "snapshots" / commit / f.path
    lock = Path(repo_dir.parent) / ".locks" / repo_dir.name / f"{f.sha256}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    blob.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(lock)):
        marker = _marker(blob, directory)

        def kept(downloaded: bool, note: bool = True) -> tuple[Path, bool]:
            """The verified blob, noted as such and linked from the snapshot."""
            if note:
                _write_marker(marker, f.sha256 or "")
            _link(blob, pointer)
            return pointer, downloaded

        if blob.exists() and marker.exists() and marker.read_text() == f.sha256:
            return kept(False, note=False)
        if blob.exists():
            # Put there by another tool, or by a pull that stopped before checking it.
            progress.status = "verifying"
            notify()
            if _verified(blob, f) is None:
                return kept(False)
            blob.unlink()
        for attempt in (1, 2):
            part = blob.with_name(blob.name + ".incomplete")
            _download(repo, commit, f, part, progress, done, notify)
            progress.status = "verifying"
            notify()
            why = _verified(part, f)
            if why is None:
                part.replace(blob)
                return kept(True)
            part.unlink(missing_ok=True)
            if attempt == 2:
                raise PullError(f"{repo}: {why}, twice; the download was removed")
            log.warning("%s; downloading it again", why)
            progress.status = "downloading"
    raise AssertionError("unreachable")


def _download(repo: str, commit: str, f: RemoteFile, part: Path, progress: PullProgress, done: int,
              notify: Callable[[], None]) -> None:
    """Fill `part` with the file, from where an earlier attempt stopped (a Range request)."""
    import sys

    import httpx
    from huggingface_hub import constants, hf_hub_url
    from huggingface_hub.utils._headers import build_hf_headers
    from tqdm.auto import tqdm

    url = hf_hub_url(repo, f.path, revision=commit)
    have = part.stat().st_size if part.exists() else 0
    if f.size is not None and have > f.size:
        part.unlink()
        have = 0
    if f.size is not None:
        import shutil

        free = shutil.disk_usage(part.parent).free
        if free < f.size - have:
            raise PullError(f"{f.path} needs {(f.size - have) / 2**30:.1f} GiB more and {part.parent} has "
                            f"{free / 2**30:.1f} GiB free (HF_HOME moves the Hub cache)")
    retries = 0
    bar = tqdm(total=f.size, initial=have, unit="B", unit_scale=True, unit_divisor=1024, desc=Path(f.path).name,
               disable=not sys.stderr.isatty() or constants.HF_HUB_DISABLE_PROGRESS_BARS is True, leave=False)
    with bar:
        while f.size is None or have < f.size:
            headers = build_hf_headers()
            headers["Accept-Encoding"] = "identity"
            if have:
                headers["Range"] = f"bytes={have}-"
            try:
                with httpx.stream("GET", url, headers=headers, follow_redirects=True,
                                  timeout=httpx.Timeout(constants.HF_HUB_DOWNLOAD_TIMEOUT, connect=30)) as r:
                    if r.status_code == 416 and f.size is not None and have >= f.size:
                        break
                    if r.status_code >= 400:
                        r.read()
                        raise PullError(f"{repo}/{f.path}: the Hub answered {r.status_code}: {r.text[:200]}")
                    if have and r.status_code == 200:  # the server ignored the Range: start again
                        have = 0
                        bar.reset(total=f.size)
                    with part.open("ab" if have else "wb") as out:
                        for chunk in r.iter_bytes(1 << 20):
                            out.write(chunk)
                            have += len(chunk)
                            bar.update(len(chunk))
                            progress.completed = done + have
                            notify()
                if f.size is None:
                    break
                retries = 0 if have else retries
            except (httpx.TransportError, OSError) as exc:
                retries += 1
                if retries > 5:
                    raise PullError(f"download of {repo}/{f.path} failed after {have} bytes: {_first_line(exc)}; "
                                    "run the pull again to go on from there") from exc
                log.warning("download of %s stopped at %d bytes (%s); going on", f.path, have, _first_line(exc))
                time.sleep(min(2 ** retries, 10))


def _fetch_plain(repo: str, commit: str, f: RemoteFile) -> Path:
    """A file the Hub lists without an LFS checksum (small, in git): huggingface-hub fetches it."""
    from huggingface_hub import hf_hub_download

    try:
        return Path(hf_hub_download(repo, f.path, revision=commit))
    except Exception as exc:  # noqa: BLE001 - said with the file's name
        raise PullError(f"download of {repo}/{f.path} failed: {_first_line(exc)}") from exc


def _marker(path: Path, directory: Path | None) -> Path:
    """A note of a verified blob (its checksum) in the user registry, so the next pull need not hash
    it again (kept out of the Hub cache, which other tools read)."""
    blob = path.resolve()
    return (directory or user_models_dir()) / ".verified" / f"{blob.parent.parent.name}--{blob.name}"


def _write_marker(marker: Path, value: str) -> None:
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(value)
    except OSError:
        pass


# --- removing -------------------------------------------------------------------------------


def _cached_links(repo: str, revision: str, files: list[str]) -> list[Path]:
    from huggingface_hub import try_to_load_from_cache

    out = []
    for f in files:
        hit = try_to_load_from_cache(repo, f, revision=revision)
        if isinstance(hit, str):
            out.append(Path(hit))
    return out


def remove(registry: Any, spec: Any) -> tuple[int, list[str]]:
    """Remove the pulled or created model `spec`: its registry entry, and the files in the Hub cache
    (or the uploaded blobs) that no other model (nor another snapshot link) uses. (bytes freed, files
    kept because others use them)."""
    from gateway.models.create import remove_created

    freed, kept = _remove_hub_files(registry, spec)
    freed += remove_created(registry, spec)
    entry = registry.user_files.get(spec.id)
    if entry is not None:
        entry.unlink(missing_ok=True)
        registry.refresh_user()
    return freed, kept


def _remove_hub_files(registry: Any, spec: Any) -> tuple[int, list[str]]:
    src = spec.formats["gguf"].hf if "gguf" in spec.formats else None
    if src is None:
        return 0, []
    mine = [link for s in _hub_sources(spec) for link in _cached_links(s.repo, s.revision, [s.file, *s.parts])]
    others: set[Path] = set()
    for other in registry.models.values():
        if other.id == spec.id:
            continue
        others |= {p.resolve() for o in _hub_sources(other) for p in _cached_links(o.repo, o.revision, [o.file, *o.parts])}
    freed, kept = 0, []
    for link in mine:
        blob = link.resolve()
        link.unlink(missing_ok=True)
        # Another snapshot of the repository may link the same blob (another revision, or a file
        # downloaded by another tool): kept while any link remains.
        repo_dir = blob.parent.parent
        linked = blob in others or any(
            p.is_symlink() and p.resolve() == blob for p in (repo_dir / "snapshots").rglob("*"))
        if linked:
            kept.append(link.name)
            continue
        if blob.exists():
            freed += blob.stat().st_size
            blob.unlink()
        _marker(blob, registry.user_dir).unlink(missing_ok=True)
        _prune_empty(link.parent, stop=repo_dir / "snapshots")
    return freed, kept


def _hub_sources(spec: Any) -> list[Any]:
    """A model's files on the Hub: its GGUF (all its shards) and its vision projector."""
    found = [spec.formats["gguf"].hf if "gguf" in spec.formats else None, spec.mmproj.hf if spec.mmproj else None]
    return [s for s in found if s is not None]


def _prune_empty(folder: Path, stop: Path) -> None:
    while folder != stop and folder.is_relative_to(stop):
        try:
            folder.rmdir()
        except OSError:
            return
        folder = folder.parent
