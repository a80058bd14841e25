"""Models made on this machine, as Ollama's `/api/create` and `/api/copy` make them: from a model the
registry has (a new name with its own system prompt, preset messages, sampling defaults or context),
or from GGUF files uploaded first as blobs (`POST /api/blobs/sha256:<hex>`).

Blobs live in `<data>/blobs/sha256-<hex>` beside the user registry (`<data>/models.d/`); a model made
from blobs gets a folder `<data>/created/<id>/` of hard links to them under the names it was given
(a split GGUF's parts must keep their names for llama.cpp to find them), so removing the model
removes a blob only when no other model links it.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, BinaryIO

from gateway.models.gguf_info import GGUFError, read_gguf
from gateway.models.hub import DEFAULT_PULL_CONTEXT, entry_file, sha256_of, user_models_dir, write_entry
from gateway.models.quantize import SOURCES, QuantizeError, quantize, type_code
from gateway.models.registry import ModelSpec, Registry

_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_SPLIT = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@-]{0,199}$")
_GGUF_MAGIC = b"GGUF"


class CreateError(ValueError):
    """A create, copy or upload that cannot be done: `status` is the HTTP status it answers with."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def data_dir(registry: Registry) -> Path:
    return (registry.user_dir or user_models_dir()).parent


def blobs_dir(registry: Registry) -> Path:
    return data_dir(registry) / "blobs"


def created_dir(registry: Registry) -> Path:
    return data_dir(registry) / "created"


def blob_path(registry: Registry, digest: str) -> Path:
    """Where the blob `sha256:<hex>` lives (whether or not it is there); 400 for a malformed digest."""
    m = _DIGEST.match(digest)
    if m is None:
        raise CreateError(400, f"invalid digest {digest!r}: expected sha256:<64 lowercase hex digits>", "digest")
    return blobs_dir(registry) / f"sha256-{m[1]}"


class BlobUpload:
    """One upload into the blob store: the bytes are hashed as they are written, and the blob
    appears under its name only when the digest matches (a partial or wrong upload leaves nothing)."""

    def __init__(self, registry: Registry, digest: str) -> None:
        self.final = blob_path(registry, digest)
        self.want = self.final.name.removeprefix("sha256-")
        self.final.parent.mkdir(parents=True, exist_ok=True)
        self.part = self.final.with_name(f"{self.final.name}.partial-{uuid.uuid4().hex[:12]}")
        self._file: BinaryIO | None = open(self.part, "wb")  # noqa: SIM115 - closed by finish/abort
        self._hash = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> None:
        assert self._file is not None
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def finish(self) -> Path:
        assert self._file is not None
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self._file = None
        got = self._hash.hexdigest()
        if got != self.want:
            self.part.unlink(missing_ok=True)
            raise CreateError(400, f"digest mismatch: the body's sha256 is {got}, the path says {self.want}",
                              "digest")
        os.replace(self.part, self.final)
        return self.final

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.part.unlink(missing_ok=True)


def store_blob(registry: Registry, path: Path, chunk: int = 8 << 20) -> str:
    """A local file copied into the blob store (as `ollama create` uploads a FROM file); its digest."""
    digest = f"sha256:{sha256_of(path)}"
    if blob_path(registry, digest).is_file():
        return digest
    upload = BlobUpload(registry, digest)
    try:
        with open(path, "rb") as f:
            while data := f.read(chunk):
                upload.write(data)
        upload.finish()  # the file changed between the two reads: a digest mismatch
    except BaseException:
        upload.abort()
        raise
    return digest


@dataclass
class Recipe:
    """What to make: a new model `name` from `parent` (a model of the registry) or from `files`
    (file name -> blob digest), with these changes."""

    name: str
    parent: ModelSpec | None = None
    files: dict[str, str] = field(default_factory=dict)
    system: str | None = None
    messages: list[dict[str, str]] | None = None
    license: str | None = None
    defaults: dict[str, Any] = field(default_factory=dict)  # Defaults' fields
    context_length: int | None = None
    quantize: str | None = None  # a llama.cpp type (Q4_K_M, Q8_0, ...): the weights quantized to it
    progress: Callable[[str], None] | None = None  # told each step as it starts


def check_name(registry: Registry, name: str, param: str = "model") -> str:
    """The id a new model gets (Ollama's ":latest" tag dropped); 400 when it is not a usable name or
    belongs to a model of models.yaml, 409 when that model is loaded is the caller's to check."""
    if not _NAME.match(name) or ".." in name:
        raise CreateError(400, f"invalid model name {name!r}: letters, digits and . _ - : / @, at most 200",
                          param)
    model_id = name.removesuffix(":latest")
    existing = registry.get(model_id)
    if existing is not None and existing.id not in registry.user_files:
        raise CreateError(400, f"{model_id!r} is a model of models.yaml (or an alias of one); choose another name",
                          param)
    if existing is not None and existing.id != model_id:
        raise CreateError(400, f"{model_id!r} is another name of {existing.id!r}; choose another name", param)
    return model_id


# One create, copy or removal of created files at a time (they share folders and blobs).
_LOCK = threading.Lock()


def create(registry: Registry, recipe: Recipe) -> tuple[Path, list[str]]:
    """Register the model `recipe` describes (replacing a pulled or created model of that name).
    Returns (its registry entry, what was done, as Ollama's status lines say it)."""
    with _LOCK:
        return _create(registry, recipe)


def _create(registry: Registry, recipe: Recipe) -> tuple[Path, list[str]]:
    model_id = check_name(registry, recipe.name)
    steps = _Steps(recipe.progress)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    qtype = None
    if recipe.quantize:
        try:
            qtype = type_code(recipe.quantize)[0]
        except ValueError as exc:
            raise CreateError(400, f"quantize: {exc}", "quantize") from None
    folder = created_dir(registry) / entry_file(model_id).stem
    if recipe.parent is not None:
        entry = _from_parent(registry, recipe.parent, model_id)
        files = dict(recipe.parent.created.files) if recipe.parent.created is not None else {}
        steps.append(f"using model {recipe.parent.id}")
        created: dict[str, Any] = {"parent": recipe.parent.id, "files": files, "created_at": now}
        if qtype is not None:
            if "gguf" not in recipe.parent.formats:
                raise CreateError(400, f"quantize: {recipe.parent.id} has no GGUF to quantize", "quantize")
            try:
                source = registry.resolve(recipe.parent, "gguf")
            except (OSError, ValueError, RuntimeError) as exc:
                raise CreateError(400, f"quantize: {recipe.parent.id}'s GGUF is not here: {exc}", "from") from exc
            files = _quantized(registry, source, qtype, steps)
            created["files"] = files
            entry["description"] = f"{recipe.parent.id} quantized to {qtype}"
            entry.pop("pulled", None)  # its quantisation and size were the parent's
            entry["formats"]["gguf"] = {"path": ""}
        if files and (qtype is not None or _in_created(registry, recipe.parent)):
            main = next(iter(files)) if qtype is not None else Path(entry["formats"]["gguf"]["path"]).name
            _link_all(registry, files, folder)
            entry["formats"]["gguf"]["path"] = str(folder / main)
    else:
        entry, created = _from_files(registry, recipe, model_id, steps)
        created["created_at"] = now
        if qtype is not None:
            uploaded = created["files"]
            created["files"] = _quantized(registry, Path(entry["formats"]["gguf"]["path"]), qtype, steps)
            main = next(iter(created["files"]))
            _swap(_link_all(registry, created["files"], folder.with_name(folder.name + ".new")), folder)
            entry["formats"]["gguf"]["path"] = str(folder / main)
            entry["description"] = f"{main}, quantized from uploaded files"
            for digest in set(uploaded.values()):  # the unquantized upload is not kept
                _prune_blob(registry, digest)
    entry["created"] = created
    if recipe.system is not None:
        entry["system"] = recipe.system
        steps.append("using system prompt")
    if recipe.messages is not None:
        entry["messages"] = recipe.messages
        steps.append(f"using {len(recipe.messages)} preset message(s)")
    if recipe.license is not None:
        entry["license"] = recipe.license
    if recipe.defaults:
        entry["defaults"] = {**entry.get("defaults", {}), **recipe.defaults}
        steps.append("using parameters " + ", ".join(sorted(recipe.defaults)))
    if recipe.context_length is not None:
        entry["context_length"] = recipe.context_length
    try:
        ModelSpec.model_validate(entry)
    except ValueError as exc:
        raise CreateError(400, f"the model would not be valid: {exc}") from exc
    old = registry.get(model_id)
    path = write_entry(entry, registry.user_dir)
    if old is not None and old.id == model_id:
        _drop_stale_links(registry, old, keep=entry)
    registry.refresh_user()
    steps.append("writing manifest")
    return path, steps


class _Steps(list[str]):
    """The steps done so far (Ollama's status lines), each also told to `progress` as it starts."""

    def __init__(self, progress: Callable[[str], None] | None) -> None:
        super().__init__()
        self.progress = progress

    def append(self, step: str) -> None:
        super().append(step)
        if self.progress is not None:
            self.progress(step)


def _quantized(registry: Registry, source: Path, qtype: str, steps: list[str]) -> dict[str, str]:
    """`source` quantized to `qtype`, stored as a blob: {file name: sha256}."""
    try:
        have = read_gguf(source).quantization
    except GGUFError as exc:
        raise CreateError(400, f"quantize: {source.name}: {exc}", "quantize") from exc
    if have not in SOURCES:
        raise CreateError(400, f"quantize: {source.name} is {have or 'of an unknown type'}; only F16, BF16 and F32 "
                          "models are quantized (quantizing quantized weights again loses more)", "quantize")
    steps.append(f"quantizing {have} model to {qtype}")
    blobs = blobs_dir(registry)
    blobs.mkdir(parents=True, exist_ok=True)
    out = blobs / f"quantize-{uuid.uuid4().hex[:12]}.gguf"
    try:
        quantize(source, out, qtype)
        hexdigest = sha256_of(out)
        os.replace(out, blob_path(registry, f"sha256:{hexdigest}"))
    except QuantizeError as exc:
        raise CreateError(500, str(exc), "quantize") from exc
    finally:
        out.unlink(missing_ok=True)
    stem = _SPLIT.sub("", source.name).removesuffix(".gguf").removesuffix(".GGUF")
    return {f"{stem}-{qtype}.gguf": hexdigest}


def copy(registry: Registry, source: ModelSpec, destination: str) -> Path:
    """Ollama's /api/copy: `destination` becomes a model of its own with everything `source` has."""
    path, _ = create(registry, Recipe(name=destination, parent=source))
    return path


def _from_parent(registry: Registry, parent: ModelSpec, model_id: str) -> dict[str, Any]:
    entry: dict[str, Any] = parent.model_dump(mode="json", exclude_defaults=True,
                                              exclude={"id", "aliases", "created", "description"})
    entry = {"id": model_id, "description": f"made from {parent.id}", **entry}
    # A path relative to models.yaml stays right wherever the entry lives.
    for src in entry.get("formats", {}).values():
        if "path" in src:
            src["path"] = str(registry._abs(src["path"]))
    return entry


def _from_files(registry: Registry, recipe: Recipe, model_id: str,
                steps: list[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    if not recipe.files:
        raise CreateError(400, "neither `from` nor `files` given: name a model to start from, or upload GGUF "
                          "files (POST /api/blobs/<digest>) and name them in `files`", "from")
    for name, digest in recipe.files.items():
        if "/" in name or "\\" in name or name.startswith(".") or not name:
            raise CreateError(400, f"files: {name!r} is not a plain file name", "files")
        if not name.lower().endswith(".gguf"):
            raise CreateError(400, f"files: {name!r} is not a GGUF file (only GGUF models can be created here; "
                              "convert safetensors with llama.cpp's convert_hf_to_gguf.py first)", "files")
        blob = blob_path(registry, digest)
        if not blob.is_file():
            raise CreateError(400, f"files: blob {digest} ({name}) is not here: upload it first "
                              f"(POST /api/blobs/{digest})", "files")
        with open(blob, "rb") as f:
            if f.read(4) != _GGUF_MAGIC:
                raise CreateError(400, f"files: {name} ({digest}) is not a GGUF file", "files")
    models = [n for n in recipe.files if "mmproj" not in n.lower()]
    mains = [n for n in models if not _SPLIT.search(n) or _SPLIT.search(n)[1] == "00001"]  # type: ignore[index]
    if len(mains) != 1:
        raise CreateError(400, f"files: expected one model (a GGUF, or the parts of one split GGUF), got "
                          f"{sorted(models)}" + ("; vision projectors (mmproj) are not served" if
                                                 len(models) != len(recipe.files) else ""), "files")
    steps.append("parsing GGUF")
    folder = created_dir(registry) / entry_file(model_id).stem
    staged = _link_all(registry, {n: recipe.files[n] for n in models}, folder.with_name(folder.name + ".new"))
    try:
        info = read_gguf(staged / mains[0])
    except GGUFError as exc:
        shutil.rmtree(staged, ignore_errors=True)
        raise CreateError(400, f"files: {mains[0]}: {exc}", "files") from exc
    missing = [p.name for p in info.files if not p.exists()]
    if missing:
        shutil.rmtree(staged, ignore_errors=True)
        raise CreateError(400, f"files: the split model {mains[0]} needs {missing} too", "files")
    _swap(staged, folder)
    trained = info.context_length or 4096
    entry: dict[str, Any] = {
        "id": model_id,
        "description": f"{mains[0]} ({info.quantization or 'GGUF'}), created from uploaded files",
        "context_length": min(recipe.context_length or DEFAULT_PULL_CONTEXT, trained),
        "formats": {"gguf": {"path": str(folder / mains[0])}},
    }
    if info.chat_template is None:
        steps.append("the GGUF has no chat template: chat uses llama.cpp's default")
    return entry, {"parent": "", "files": {n: _DIGEST.match(recipe.files[n])[1] for n in models}}  # type: ignore[index]


def _link_all(registry: Registry, files: dict[str, str], folder: Path) -> Path:
    """`folder` with a hard link (a copy where links cannot be made) to each blob under its name."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name, digest in files.items():
        blob = blob_path(registry, digest if digest.startswith("sha256") else f"sha256:{digest}")
        try:
            os.link(blob, folder / name)
        except OSError:
            shutil.copy2(blob, folder / name)
    return folder


def _swap(staged: Path, folder: Path) -> None:
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    staged.rename(folder)
    shutil.rmtree(old, ignore_errors=True)


def _in_created(registry: Registry, spec: ModelSpec) -> bool:
    src = spec.formats.get("gguf")
    return bool(src is not None and src.path and Path(src.path).is_relative_to(created_dir(registry)))


def _drop_stale_links(registry: Registry, old: ModelSpec, keep: dict[str, Any]) -> None:
    """After `old` was replaced: blobs only its links held go."""
    if old.created is None:
        return
    now = {d for d in keep.get("created", {}).get("files", {}).values()}
    for digest in set(old.created.files.values()) - now:
        _prune_blob(registry, digest)


def remove_created(registry: Registry, spec: ModelSpec) -> int:
    """The created model's folder of links, and each blob no other model links (bytes freed)."""
    if spec.created is None or not _in_created(registry, spec):
        return 0
    with _LOCK:
        folder = Path(spec.formats["gguf"].path or "").parent
        shutil.rmtree(folder, ignore_errors=True)
        return sum(_prune_blob(registry, d) for d in set(spec.created.files.values()))


def _prune_blob(registry: Registry, digest: str) -> int:
    blob = blob_path(registry, f"sha256:{digest}")
    try:
        st = blob.stat()
    except FileNotFoundError:
        return 0
    if st.st_nlink > 1:
        return 0  # another created model links it
    blob.unlink(missing_ok=True)
    return st.st_size
