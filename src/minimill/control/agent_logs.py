"""What `minimill agent logs` shows of an agent: its harness's ctx.log lines, each box exec
that failed (its exit code and the tail of its stderr: a harness that went on regardless still
shows why its result is thin) and how a failed agent ended."""

from __future__ import annotations

from typing import Any

from minimill.control.agents import AgentStatus, get_agent, journal
from minimill.control.store import Store

STDERR_TAIL_CHARS = 500  # of a failed box exec


def log_lines(store: Store, tenant_id: str, agent_id: str) -> list[tuple[str, str]]:
    """What `agent logs` shows, as (journal key, message): the harness's ctx.log lines, each
    box exec that failed (its exit code and the tail of its stderr), and how a failed agent
    ended, in order."""
    record = get_agent(store, tenant_id, agent_id)
    lines = []
    for entry in journal(store, tenant_id, agent_id):
        if entry.kind == "log":
            lines.append((entry.key, str(entry.value)))
        elif entry.kind == "exec" and isinstance(entry.value, dict) and (
                entry.value.get("exit_code") != 0 or entry.value.get("error")):
            lines.append((entry.key, _failed_exec(entry.value)))
    if record.status == AgentStatus.FAILED.value and isinstance(record.error, dict):
        lines.append(("error", f"failed: {record.error.get('message') or ''}".strip()))
    return lines


def _failed_exec(result: dict[str, Any]) -> str:
    stderr = str(result.get("stderr") or "").strip()[-STDERR_TAIL_CHARS:]
    error = f" ({result['error']})" if result.get("error") else ""
    return (f"box exec exited {result.get('exit_code')}{error}"
            + (f"; stderr: {stderr}" if stderr else ""))
