"""Deep research over a corpus in the agent's box, as a durable minimill harness.

    minimill agent run examples/deep_research/harness.py --box-image corpus/ \
        --task '{"question": "What is the vault code of Station Kestrel?", "subject": "Kestrel"}'

The root agent splits the documents into groups and fans out one subagent per group (ctx.map).
Each subagent reads its documents in the box (the sentences about vault codes), asks the model
which code the question's station has, and reports what it found. The root then checks each
proposed answer against the documents in the box and answers with the one they confirm.
"""

import re

PROMPT = ("Notes:\n{notes}\n\nQuestion: {question}\n"
          "If the notes answer it, reply with the code only. Otherwise reply NONE.")


async def main(ctx, task):
    question = task["question"]
    subject = task["subject"]
    per_group = int(task.get("docs_per_subagent", 10))
    listing = await ctx.box.exec("ls docs")
    names = sorted(listing["stdout"].split())
    groups = [names[i:i + per_group] for i in range(0, len(names), per_group)]
    await ctx.log(f"{len(names)} documents, {len(groups)} subagents")

    async def read_group(sub, group):
        paths = " ".join(f"docs/{name}" for name in group)
        # Read the group's documents in the box, sentence by sentence: what they say about
        # the subject, else what they say about vault codes at all.
        found = await sub.box.exec(
            f"cat {paths} | tr '.' '\\n' > /tmp/s; grep -i '{subject}' /tmp/s "
            "|| grep -i 'vault code' /tmp/s || true")
        notes = found["stdout"].strip() or "(nothing about vault codes)"
        reply = await sub.chat(PROMPT.format(notes=notes[:1200], question=question),
                               max_tokens=16)
        return {"codes": re.findall(r"\b\d{4}\b", reply), "reply": reply.strip()}

    reports = await ctx.map(read_group, groups, concurrency=int(task.get("concurrency", 32)))
    candidates = sorted({code for r in reports for code in r["codes"]})
    await ctx.log(f"{len(candidates)} candidate codes from {len(reports)} subagents")

    # The model proposes; the documents decide: keep the codes stated for the subject.
    confirmed = []
    for code in candidates:
        check = await ctx.box.exec(
            f"grep -l -i 'station {subject} is {code}' docs/* | wc -l")
        if int(check["stdout"].strip() or 0) > 0:
            confirmed.append(code)
    answer = confirmed[0] if len(confirmed) == 1 else None
    await ctx.log(f"answer {answer} (confirmed: {confirmed})")
    return {"answer": answer, "confirmed": confirmed, "candidates": len(candidates),
            "subagents": len(reports), "spent_tokens": ctx.budget.spent_tokens}
