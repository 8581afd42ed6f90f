"""`minimill bench agents`: the deep-research example (examples/deep_research) on a local
fleet: a serve whose local worker serves the model and hosts the agent's box, plus a separate
runner process for the agent.

Figures: subagents, total_tokens (every model call's usage, from the journal), seconds (agent
start to finish), avg_batch_size (sequences per engine step over the run: subagents batch
together in the engine), output_tok_s (the agent's completion tokens per second) vs
engine_output_tok_s (the builtin engine alone, offline, generating the same prompts on the
same machine), answer_correct; then the same with the runner killed -9 twice mid-run (kills,
replayed_effects, repeated_effects, which must be 0).
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from minimill.bench.local_fleet import BenchError, LocalFleet, LocalProcess

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "deep_research"
_STEPS = re.compile(r"worker\[local\].*stats generated_tokens=\d+ held=\d+ steps=(\d+) "
                    r"step_seqs=(\d+)")
FLEET_ENV = {"MINIMILL_LEASE_TTL_S": "4", "MINIMILL_JANITOR_INTERVAL_S": "0.2",
             "MINIMILL_WORKER_STATS_S": "0.5", "MINIMILL_LOG_LEVEL": "INFO"}


def _module(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise BenchError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step_counts(log: Path) -> tuple[int, int]:
    found = _STEPS.findall(log.read_text(errors="replace"))
    return (int(found[-1][0]), int(found[-1][1])) if found else (0, 0)


class AgentRun:
    """One run of the example on the fleet, with a runner that may be killed."""

    def __init__(self, fleet: LocalFleet, corpus: Path, task: dict[str, Any]) -> None:
        from minimill.client.agents import Agents

        self.fleet = fleet
        self.agents = Agents(fleet.base_url, fleet.key)
        self.corpus = corpus
        self.task = task
        self.runners: list[LocalProcess] = []

    def start_runner(self) -> None:
        name = f"runner-{len(self.runners)}-{int(time.time() * 1000) % 100000}"
        proc = self.fleet.worker(name, self.fleet.site_token(name), "--engine", "none",
                                 "--agents", "4")
        proc.start()
        proc.wait_for_log(r"worker for site .* ready")
        self.runners.append(proc)

    def run(self, kills: int) -> dict[str, Any]:
        self.start_runner()
        before = _step_counts(self.fleet.serve.log_path)
        started = time.perf_counter()
        agent_id = self.agents.run(EXAMPLE / "harness.py", self.task, box_image=self.corpus)
        done_kills = 0
        while True:
            agent = self.agents.get(agent_id)
            if agent["status"] in ("succeeded", "failed", "cancelled"):
                break
            journaled = agent["journaled_effects"]
            # Kill the runner at two points of the fan-out (a third and two thirds of it).
            due = done_kills < kills and journaled >= (done_kills + 1) * self._fanout() / (
                kills + 1)
            if due:
                self.runners[-1].kill9()
                done_kills += 1
                self.start_runner()
            time.sleep(0.2)
        seconds = time.perf_counter() - started
        time.sleep(1.0)  # the local worker's next stats line
        after = _step_counts(self.fleet.serve.log_path)
        for runner in self.runners:
            runner.stop()
        self.runners.clear()
        if agent["status"] != "succeeded":
            raise BenchError(f"the agent ended {agent['status']}: {agent.get('error')}")
        journal = self.agents.journal(agent_id)
        usages = [e["value"].get("usage") or {} for e in journal if e["kind"] == "chat"]
        steps, seqs = after[0] - before[0], after[1] - before[1]
        completion = sum(int(u.get("completion_tokens") or 0) for u in usages)
        return {"agent": agent, "seconds": seconds, "chats": len(usages),
                "total_tokens": sum(int(u.get("total_tokens") or 0) for u in usages),
                "completion_tokens": completion, "output_tok_s": completion / seconds,
                "avg_batch_size": seqs / steps if steps else 0.0, "kills": done_kills}

    def _fanout(self) -> float:
        # Effects of the fan-out: per subagent an exec, a chat and its result.
        return 3 * -(-1000 // int(self.task.get("docs_per_subagent", 10)))


def _prompts(corpus: Path, task: dict[str, Any]) -> list[str]:
    """The subagents' prompts, built as harness.py builds them (the offline engine's work)."""
    harness = _module(EXAMPLE / "harness.py")
    names = sorted(p.name for p in (corpus / "docs").iterdir())
    per = int(task.get("docs_per_subagent", 10))
    prompts = []
    for i in range(0, len(names), per):
        text = " ".join((corpus / "docs" / n).read_text() for n in names[i:i + per])
        sentences = text.replace(".", "\n").splitlines()
        lines = ([s for s in sentences if task["subject"].lower() in s.lower()]
                 or [s for s in sentences if "vault code" in s.lower()])
        notes = "\n".join(lines).strip() or "(nothing about vault codes)"
        prompts.append(harness.PROMPT.format(notes=notes[:1200], question=task["question"]))
    return prompts


def _engine_tok_s(model: str, dtype: str, prompts: list[str]) -> float:
    """The builtin engine alone generating the same prompts; in a child process so that its
    memory and threads go when it ends."""
    code = ("import json,sys,time\nfrom minimill.engine.llm import LLM\n"
            "from minimill.engine.params import SamplingParams\n"
            "args=json.load(sys.stdin)\nllm=LLM(args['model'],dtype=args['dtype'])\n"
            "convs=[[{'role':'user','content':p}] for p in args['prompts']]\n"
            "llm.chat(convs[:1],SamplingParams(max_tokens=2,temperature=0))\n"
            "t=time.perf_counter()\n"
            "outs=llm.chat(convs,SamplingParams(max_tokens=16,temperature=0))\n"
            "s=time.perf_counter()-t\n"
            "print(json.dumps(sum(len(o.output_token_ids) for o in outs)/s))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          input=json.dumps({"model": model, "dtype": dtype,
                                            "prompts": prompts}), timeout=1800)
    if proc.returncode != 0:
        raise BenchError(f"the offline engine run failed: {proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def run_agents_bench(*, model: str, dtype: str, json_out: bool, docs: int = 1000,
                     docs_per_subagent: int = 10, concurrency: int = 32) -> dict[str, Any]:
    make_corpus = _module(EXAMPLE / "make_corpus.py")
    err = sys.stderr
    with tempfile.TemporaryDirectory(prefix="minimill-agents-") as tmp:
        corpus = Path(tmp) / "corpus"
        facts = make_corpus.write_corpus(corpus, docs)
        task = {"question": facts["question"], "subject": make_corpus.SUBJECT,
                "docs_per_subagent": docs_per_subagent, "concurrency": concurrency}
        fleet = LocalFleet(model, dtype, env=FLEET_ENV, serve_args=("--agents", "0"))
        try:
            print("starting the fleet ...", file=err, flush=True)
            fleet.start()
            bench = AgentRun(fleet, corpus, task)
            print("running the agent ...", file=err, flush=True)
            plain = bench.run(kills=0)
            print(f"  {plain['seconds']:.1f}s; again with the runner killed twice ...",
                  file=err, flush=True)
            killed = bench.run(kills=2)
        finally:
            fleet.close()
        print("the engine alone on the same prompts ...", file=err, flush=True)
        engine_tok_s = _engine_tok_s(model, dtype, _prompts(corpus, task))
    result = plain["agent"]["result"]
    report = {
        "model": model, "docs": docs, "subagents": result["subagents"],
        "total_tokens": plain["total_tokens"], "seconds": round(plain["seconds"], 2),
        "avg_batch_size": round(plain["avg_batch_size"], 2),
        "output_tok_s": round(plain["output_tok_s"], 2),
        "engine_output_tok_s": round(engine_tok_s, 2),
        "answer": result["answer"], "answer_correct": result["answer"] == facts["answer"],
        "with_kills": {
            "kills": killed["kills"], "seconds": round(killed["seconds"], 2),
            "replayed_effects": killed["agent"]["replayed_effects"],
            "repeated_effects": killed["agent"]["repeated_effects"],
            "restarts": killed["agent"]["restarts"],
            "answer_correct": killed["agent"]["result"]["answer"] == facts["answer"],
            "avg_batch_size": round(killed["avg_batch_size"], 2)},
    }
    print(json.dumps(report) if json_out else json.dumps(report, indent=2))
    return report
