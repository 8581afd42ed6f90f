"""A model whose weights the engine takes over as it builds (random weights, a memory budget's
load) peaks at about one copy of them, not two: the weights as loaded are freed layer by layer
into malloc's heaps, which the engine keeps (memory.py), and handed back to the OS as it goes.
Before, a 2.9B-parameter mixture of experts in float32 (10.6 GiB) peaked at 23 GiB and was
killed on a 24 GiB machine."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

GIB = 1 << 30

# In a process of its own: its peak resident memory is the load's alone.
LOAD = textwrap.dedent("""
    import json, resource, torch
    from minimill.engine.llm import LLM
    from minimill.models.loader import load_model
    from minimill.models.shapes import NAMED_SHAPES, random_model

    def peak():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    shape = NAMED_SHAPES["qwen3-0.6b"]
    tokenizer = load_model("smollm2-135m", torch.float32, auto_pull=True).tokenizer
    before = peak()
    loaded = random_model("qwen3-0.6b", shape, torch.float32, tokenizer)
    weights = sum(t.numel() * t.element_size() for t in loaded.weights.values())
    embedding = loaded.weights["model.embed_tokens.weight"]
    head_copy = embedding.numel() * embedding.element_size()  # tied: the head packs its own
    LLM(loaded, dtype="float32", num_kv_blocks=16)
    print(json.dumps({"before": before, "peak": peak(), "weights": weights,
                      "head_copy": head_copy}))
""")


def test_an_engine_taking_its_weights_over_peaks_at_one_copy_of_them(model_file: object) -> None:
    out = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True,
                         timeout=600, check=True)
    figures = json.loads(out.stdout.strip().splitlines()[-1])
    grown = figures["peak"] - figures["before"]
    one_copy = figures["weights"] + figures["head_copy"]
    assert figures["weights"] > 2 * GIB  # big enough for a second copy to show
    # Measured: 2.39 GiB grown against 2.80 of one copy (the peak's baseline already held
    # the tokenizer's load); 3.36 when the freed weights stayed in malloc's heaps.
    assert grown < one_copy + 0.1 * GIB, figures
