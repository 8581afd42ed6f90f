"""A tenant asking for more than the operator allows (`--box-max-*`, MINIMILL_BOX_MAX_*):
a 400 naming the limit, never a silent clamp; a limit left out is the lower of the default
and the cap."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from api_harness import ApiEnv, start_env, stop_env

from minimill.client.boxes import BoxError, Boxes


@pytest.fixture(scope="module")
def capped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiEnv]:
    url = f"sqlite:///{tmp_path_factory.mktemp('capsdb') / 'minimill.db'}"
    env = start_env("sqlite", url, box_max_memory_mb=512, box_max_processes=32,
                    box_max_cpu_s=120, box_max_exec_s=300, box_max_disk_mb=256)
    yield env
    stop_env(env)


@pytest.mark.parametrize(("name", "asked", "option"), [
    ("memory_mb", 1024 * 1024, "--box-max-memory-mb"),
    ("max_processes", 4096, "--box-max-processes"),
    ("cpu_s", 7 * 24 * 3600, "--box-max-cpu-s"),
    ("timeout_s", 7 * 24 * 3600, "--box-max-exec-s"),
    ("disk_mb", 1024 * 1024, "--box-max-disk-mb"),
])
def test_each_limit_over_its_cap_is_a_400(capped: ApiEnv, name: str, asked: int,
                                          option: str) -> None:
    with Boxes(capped.v1, capped.key, timeout_s=30) as boxes:
        with pytest.raises(BoxError) as err:
            boxes.create(limits={name: asked})
        assert (err.value.status, err.value.code) == (400, "limit_over_cap")
        assert option in err.value.message
        assert boxes.list() == []  # nothing was created
    body = _raw_error(capped, {"limits": {name: asked}})
    assert body["param"] == f"limits.{name}" and body["type"] == "invalid_request_error"


def _raw_error(env: ApiEnv, payload: dict[str, object]) -> dict[str, object]:
    import httpx

    resp = httpx.post(env.v1 + "/boxes", json=payload,
                      headers={"Authorization": f"Bearer {env.key}"}, timeout=30)
    assert resp.status_code == 400
    error: dict[str, object] = resp.json()["error"]
    return error


def test_within_the_caps_and_defaults_fit_under_them(capped: ApiEnv) -> None:
    with Boxes(capped.v1, capped.key, timeout_s=30) as boxes:
        box = boxes.create(limits={"memory_mb": 512, "max_processes": 32})
        limits = box.refresh().data["limits"]
        # Left out: the default, or the cap where the default is higher (disk 1024 > 256).
        assert limits == {"cpu_s": 60, "memory_mb": 512, "max_processes": 32, "disk_mb": 256,
                          "timeout_s": 60.0}
        with pytest.raises(BoxError) as err:
            box.exec("true", timeout_s=301)
        assert (err.value.status, err.value.code) == (400, "limit_over_cap")
        assert "timeout_s" in err.value.message


def test_defaults_are_caps_unless_set() -> None:
    from minimill.api.settings import Settings
    from minimill.transport.box_protocol import DEFAULT_BOX_CAPS

    assert Settings().box_caps() == DEFAULT_BOX_CAPS
