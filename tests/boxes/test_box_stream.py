"""Streamed exec output end to end: a real box host process posts a running command's output
while it runs (bubblewrap), the control plane stores it and serves it as server-sent events,
and the SDK reads it as it comes."""

from __future__ import annotations

import json
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from api_harness import ApiEnv, ServerThread
from box_harness import BoxHostProc
from sqlalchemy import func, select

from minimill.api.settings import Settings
from minimill.client.boxes import Box, BoxError, Boxes, ExecEvent
from minimill.control.tables import box_op_output, box_ops
from minimill.transport.box_protocol import BOX_FLEET_PREFIX, MAX_EXEC_OUTPUT_BYTES

# Every test of this module runs against SQLite and PostgreSQL stores.
pytestmark = pytest.mark.parametrize(
    "box_env", ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)],
    indirect=True, scope="module")

# One line, a pause longer than the time it takes output to get through, another line.
SLOW = "echo first; echo oops >&2; sleep 1.5; echo second; echo done >&2; exit 3"


@dataclass
class Received:
    at: float  # time.monotonic() when it arrived
    id: str | None
    payload: Any  # the JSON object, or "[DONE]"


def _post_stream(env: ApiEnv, box_id: str, body: dict[str, Any],
                 headers: dict[str, str] | None = None,
                 ) -> tuple[httpx.Response, list[Received]]:
    """The raw answer: status, headers and each server-sent event with when it arrived."""
    events: list[Received] = []
    with httpx.Client(timeout=120) as http, http.stream(
            "POST", f"{env.v1}/boxes/{box_id}/exec", json={"stream": True, **body},
            headers={"Authorization": f"Bearer {env.key}", **(headers or {})}) as resp:
        if resp.status_code != 200:
            resp.read()
            return resp, events
        event_id, data = None, []
        for line in resp.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: "):
                data.append(line[6:])
            elif not line and data:
                text = "\n".join(data)
                payload = text if text == "[DONE]" else json.loads(text)
                events.append(Received(time.monotonic(), event_id, payload))
                event_id, data = None, []
    return resp, events


def _text(events: list[Received], stream: str) -> str:
    return "".join(e.payload["data"] for e in events
                   if isinstance(e.payload, dict) and e.payload["type"] == stream)


def _stored_chunks(env: ApiEnv) -> int:
    with env.store.read() as conn:
        return int(conn.execute(select(func.count()).select_from(box_op_output)).scalar() or 0)


def test_output_arrives_while_the_command_runs(box_env: ApiEnv, box_host: BoxHostProc,
                                               boxes: Boxes) -> None:
    box = boxes.create()
    resp, events = _post_stream(box_env, box.id, {"command": SLOW})
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/event-stream")
    assert events[-1].payload == "[DONE]"
    exit_event = events[-2].payload
    assert exit_event["type"] == "exit"
    assert {k: exit_event[k] for k in ("exit_code", "timed_out", "error", "output_truncated")} \
        == {"exit_code": 3, "timed_out": False, "error": None, "output_truncated": False}
    assert exit_event["duration_s"] >= 1.5
    assert "stdout" not in exit_event  # the output came as it went
    output = events[:-2]
    assert output and all(e.payload["type"] in ("stdout", "stderr") for e in output)
    assert all(e.id for e in output)  # each one a position to resume from
    # Separated, complete and in order.
    assert _text(events, "stdout") == "first\nsecond\n"
    assert _text(events, "stderr") == "oops\ndone\n"
    # The first line came while the command still slept, not with its end.
    first = next(e for e in output if "first" in e.payload["data"])
    assert events[-2].at - first.at >= 1.0, [(e.at, e.payload) for e in events]
    # What the non-streamed call answers for the same command.
    whole = box.exec(SLOW)
    assert (whole.exit_code, whole.stdout, whole.stderr) == (3, "first\nsecond\n",
                                                            "oops\ndone\n")
    # Chunks go once the exec has ended: its result holds the output.
    assert _stored_chunks(box_env) == 0
    box.delete()


def test_sdk_exec_stream(box_host: BoxHostProc, boxes: Boxes) -> None:
    box = boxes.create()
    timed: list[tuple[float, ExecEvent]] = []
    for event in box.exec_stream(["sh", "-c", "cat; echo $GREETING >&2; sleep 1.5; "
                                  "echo second"], stdin="piped\n", env={"GREETING": "hi"}):
        timed.append((time.monotonic(), event))
    kinds = [e.type for _, e in timed]
    assert kinds[-1] == "exit" and set(kinds[:-1]) <= {"stdout", "stderr"}, kinds
    result = timed[-1][1].result
    assert result is not None
    assert (result.exit_code, result.stdout, result.stderr, result.error) == (
        0, "piped\nsecond\n", "hi\n", None)
    first_at = next(at for at, e in timed if "piped" in e.data)
    assert timed[-1][0] - first_at >= 1.0
    # A limit that ends the command ends the stream with the result saying so.
    events = list(box.exec_stream("echo before; sleep 30", timeout_s=1))
    result = events[-1].result
    assert result is not None and result.timed_out and result.error == "timeout"
    assert result.stdout == "before\n"
    box.delete()


def test_errors_are_openai_error_objects(box_env: ApiEnv, box_host: BoxHostProc,
                                         boxes: Boxes) -> None:
    resp, _ = _post_stream(box_env, "box_doesnotexist", {"command": "true"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "box_not_found"
    with pytest.raises(BoxError) as err:
        next(Box(boxes, {"id": "box_doesnotexist"}).exec_stream("true"))
    assert (err.value.status, err.value.code) == (404, "box_not_found")

    box = boxes.create()
    for body in ({"command": []}, {"command": "true", "stream": "sure"},
                 {"command": "true", "timeout_s": -1}):
        resp, _ = _post_stream(box_env, box.id, body)
        assert resp.status_code == 400
        assert resp.json()["error"]["type"] == "invalid_request_error"
    resp, _ = _post_stream(box_env, box.id, {"command": "true"},
                           headers={"Last-Event-ID": "not a position"})
    assert resp.status_code == 400
    assert resp.json()["error"]["code"] == "invalid_last_event_id"

    # Deleted while it runs: the stream ends with the error the non-streamed call answers.
    with Boxes(box_env.v1, box_env.key, timeout_s=60) as other:
        stream = box.exec_stream("echo started; sleep 30")
        first = next(stream)
        assert (first.type, first.data) == ("stdout", "started\n")
        other.get(box.id).delete()
        with pytest.raises(BoxError) as err:
            list(stream)
        assert (err.value.status, err.value.code) == (409, "box_deleted")


def test_resume_from_another_control_plane(box_env: ApiEnv, box_host: BoxHostProc,
                                           boxes: Boxes) -> None:
    """A client that lost the stream resumes it, through another control-plane process (as
    after a restart), from its last event: every piece once, and the command ran once."""
    box = boxes.create()
    key = f"stream-{uuid.uuid4().hex}"
    command = "echo run >> runs.txt; echo one; sleep 1; echo two; sleep 1; echo three >&2"
    stream = box.exec_stream(command, idempotency_key=key)
    first = next(stream)
    assert (first.type, first.data) == ("stdout", "one\n") and first.id
    stream.close()  # the connection is gone

    other = ServerThread(Settings(db=box_env.db_url, janitor_interval_s=0.1, lease_ttl_s=3.0,
                                  run_janitor=False))
    try:
        with Boxes(other.base_url + "/v1", box_env.key, timeout_s=60) as there:
            again = there.get(box.id)
            rest = list(again.exec_stream(command, idempotency_key=key,
                                          last_event_id=first.id))
            result = rest[-1].result
            assert result is not None and result.exit_code == 0
            assert (result.stdout, result.stderr) == ("two\n", "three\n")
            assert "one" not in "".join(e.data for e in rest)
            # Once it ended, the same position reads the same rest (from the result), and no
            # position reads all of it.
            after_end = list(again.exec_stream(command, idempotency_key=key,
                                               last_event_id=first.id))
            assert after_end[-1].result is not None
            assert (after_end[-1].result.stdout, after_end[-1].result.stderr) == (
                "two\n", "three\n")
            whole = list(again.exec_stream(command, idempotency_key=key))[-1].result
            assert whole is not None
            assert (whole.stdout, whole.stderr) == ("one\ntwo\n", "three\n")
    finally:
        other.stop()
    assert box.read_text("runs.txt") == "run\n"
    box.delete()


def _running_op(env: ApiEnv, box_id: str) -> tuple[str, int]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        with env.store.read() as conn:
            row = conn.execute(select(box_ops.c.id, box_ops.c.epoch).where(
                box_ops.c.box_id == box_id, box_ops.c.status == "running")).first()
        if row is not None:
            return str(row.id), int(row.epoch)
        time.sleep(0.05)
    raise AssertionError("the exec never started")


def test_output_is_fenced_by_the_lease(box_env: ApiEnv, box_host: BoxHostProc,
                                       boxes: Boxes) -> None:
    box = boxes.create()
    events: list[ExecEvent] = []
    reader = threading.Thread(target=lambda: events.extend(box.exec_stream("sleep 3")))
    reader.start()
    op_id, epoch = _running_op(box_env, box.id)

    def post(token: str, epoch: int, seq: int, data: str) -> httpx.Response:
        return httpx.post(f"{box_env.base_url}{BOX_FLEET_PREFIX}/output", timeout=30,
                          headers={"Authorization": f"Bearer {token}"},
                          json={"op_id": op_id, "box_id": box.id, "epoch": epoch,
                                "chunks": [{"seq": seq, "stream": "stdout", "data": data}]})

    assert post(box_host.token, epoch - 1, 1, "from a stale lease\n").status_code == 409
    assert post(box_env.site_token, epoch, 1, "from another site\n").status_code == 409
    # Its own host at the current epoch is heard; the same chunk sent again is stored once.
    assert post(box_host.token, epoch, 1, "from its host\n").json() == {"stored": 1}
    assert post(box_host.token, epoch, 1, "from its host\n").json() == {"stored": 0}
    reader.join(timeout=60)
    assert events[-1].result is not None and events[-1].result.exit_code == 0
    assert "".join(e.data for e in events) == "from its host\n"
    assert post(box_host.token, epoch, 2, "after the end\n").status_code == 409
    box.delete()


def test_streamed_output_is_capped_like_the_result(box_env: ApiEnv, box_host: BoxHostProc,
                                                   boxes: Boxes) -> None:
    box = boxes.create()
    events = list(box.exec_stream("head -c 1500000 /dev/zero | tr '\\0' x; echo tail >&2"))
    result = events[-1].result
    assert result is not None and result.output_truncated
    streamed = "".join(e.data for e in events if e.type == "stdout")
    assert len(streamed) == MAX_EXEC_OUTPUT_BYTES and set(streamed) == {"x"}
    assert result.stderr == "tail\n"
    assert box.exec("head -c 1500000 /dev/zero | tr '\\0' x").stdout == streamed
    assert _stored_chunks(box_env) == 0
    box.delete()
