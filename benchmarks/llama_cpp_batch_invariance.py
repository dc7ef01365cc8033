"""Does llama.cpp give a position the same logits whether it computes it alone or inside a batch?

Speculative verification computes K + 1 positions in one forward where plain decoding computes one,
so an engine whose logits depend on the batch can answer differently with speculation under greedy
decoding, with nothing wrong in the speculation. This measures it on a llama-server without
speculation (the build `make install-llama-cpp` made), for each GGUF file given:

    python benchmarks/llama_cpp_batch_invariance.py --gguf A.gguf --gguf B.gguf --tokens 64

1. The greedy answer to each prompt, decoded one token per forward, with the top-2 log-probabilities
   at each position (``n_probs``).
2. For each position i, the prompt and the answer's first i tokens sent again with the prompt cache
   off, so the whole sequence is one batched forward, and the top-2 at its last position.

Printed per file: positions compared, positions whose likeliest token differs, the largest gap
between the two log-probabilities of the greedy token, and the smallest top-2 margin among the flips.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

from specbench.engines import llamacpp
from specbench.engines.launch import launched

PROMPTS = [
    "def fibonacci(n):\n    ",
    "Summarize in one sentence: The committee met on Tuesday to discuss the new budget, which",
    "Translate to French: The weather is nice today and",
]


def complete(root: str, body: dict) -> dict:
    request = urllib.request.Request(
        root + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def top2(probabilities: dict) -> list[tuple[int, float]]:
    return [(t["id"], t["logprob"]) for t in probabilities["top_logprobs"][:2]]


def measure(root: str, prompt: str, tokens: int) -> list[tuple[list, list]]:
    """(sequential top-2, batched top-2) at each position of the greedy answer to ``prompt``."""
    request = urllib.request.Request(
        root + "/tokenize", json.dumps({"content": prompt}).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        ids = json.loads(response.read())["tokens"]
    greedy = complete(
        root,
        {
            "prompt": ids,
            "n_predict": tokens,
            "temperature": 0,
            "n_probs": 2,
            "cache_prompt": False,
            "return_tokens": True,
        },
    )
    answer = greedy["tokens"]
    sequential = [top2(p) for p in greedy["completion_probabilities"]]
    pairs = []
    for i in range(1, len(answer)):  # position i: after the prompt and i answer tokens, as a batch
        one = complete(
            root, {"prompt": ids + answer[:i], "n_predict": 1, "temperature": 0, "n_probs": 2, "cache_prompt": False}
        )
        pairs.append((sequential[i], top2(one["completion_probabilities"][0])))
    return pairs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", action="append", required=True)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    server = llamacpp.find_server()
    with tempfile.TemporaryDirectory() as logs:
        for path in args.gguf:
            command = llamacpp.command(server, Path(path), 1, 1024)
            with launched(Path(path).stem, command, Path(logs), who="llama-server") as url:
                root = url.removesuffix("/v1")
                pairs = [pair for prompt in PROMPTS for pair in measure(root, prompt, args.tokens)]
            flips = [(s, b) for s, b in pairs if s[0][0] != b[0][0]]
            gaps = [abs(s[0][1] - next((lp for t, lp in b if t == s[0][0]), float("nan"))) for s, b in pairs]
            margins = [s[0][1] - s[1][1] for s, _ in flips]
            smallest = f"; smallest sequential top-2 margin among them {min(margins):.3f} nats" if margins else ""
            print(
                f"{Path(path).name}: {len(pairs)} positions, {len(flips)} with another likeliest token batched; "
                f"largest log-probability gap of the greedy token {max(g for g in gaps if g == g):.4f} nats{smallest}"
            )


if __name__ == "__main__":
    main()
