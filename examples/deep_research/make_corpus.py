"""Write a corpus of small generated documents with a few planted facts.

    python examples/deep_research/make_corpus.py corpus/ --docs 1000

Every document is a short field report about a made-up research station; some mention the
vault code of some station (decoys); the code of Station Kestrel is planted in a few of them.
The question the example asks is the one `QUESTION` states; `ANSWER` is its answer.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SUBJECT = "Kestrel"
QUESTION = f"What is the vault code of Station {SUBJECT}?"
ANSWER = "4817"
STATIONS = ["Osprey", "Heron", "Falcon", "Plover", "Curlew", "Merlin", "Harrier", "Dunlin",
            "Gannet", "Petrel", "Shrike", "Wagtail"]
TOPICS = ["tide gauges", "soil cores", "lichen samples", "wind sensors", "ice probes",
          "seismic logs", "water samples", "pollen traps", "snow pits", "drone surveys"]
VERBS = ["calibrated", "replaced", "collected", "inspected", "logged", "repaired"]


def document(rng: random.Random, index: int) -> str:
    station = rng.choice(STATIONS)
    lines = [f"Field report {index} from Station {station}."]
    for _ in range(rng.randint(3, 5)):
        lines.append(f"The team {rng.choice(VERBS)} the {rng.choice(TOPICS)} on day "
                     f"{rng.randint(1, 300)}.")
    if rng.random() < 0.3:  # a decoy: another station's code
        other = rng.choice(STATIONS)
        lines.insert(rng.randint(1, len(lines)),
                     f"The vault code of Station {other} is {rng.randint(1000, 9999)}.")
    return " ".join(lines) + "\n"


def write_corpus(root: Path, num_docs: int = 1000, num_planted: int = 3,
                 seed: int = 7) -> dict[str, object]:
    """Write `num_docs` documents under root/docs; returns what was planted where."""
    rng = random.Random(seed)
    docs = root / "docs"
    docs.mkdir(parents=True, exist_ok=True)
    planted = sorted(rng.sample(range(num_docs), num_planted))
    for i in range(num_docs):
        text = document(rng, i)
        if i in planted:
            sentences = text.split(". ")
            sentences.insert(1, f"The vault code of Station {SUBJECT} is {ANSWER}")
            text = ". ".join(sentences)
        (docs / f"doc_{i:04d}.txt").write_text(text)
    facts = {"question": QUESTION, "answer": ANSWER, "planted_in": planted,
             "docs": num_docs}
    (root / "facts.json").write_text(json.dumps(facts, indent=2))
    return facts


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", type=Path, help="Directory to write docs/ and facts.json to.")
    parser.add_argument("--docs", type=int, default=1000)
    parser.add_argument("--planted", type=int, default=3)
    args = parser.parse_args()
    print(json.dumps(write_corpus(args.root, args.docs, args.planted)))
