"""A speculating llama-server's first greedy answer, against its later ones and a plain server's.

    python benchmarks/llama_cpp_first_request.py --gguf TARGET.gguf --spec "--spec-type ngram-simple --spec-draft-n-max 3"

Starts a llama-server without speculation and one with the --spec arguments (the build `make
install-llama-cpp` made, one slot each), and sends each the same greedy request --repeats times
(HumanEval/0's text, --tokens new tokens). Prints, per server, whether each answer equals the plain
server's first, and where it first differs (in characters). `specbench audit --engine llama-cpp`
found the speculating servers' greedy answers differing from the baseline's on the target's Q4_1
file; this shows it without specbench's client, and without a draft model (docs/audit.md).
"""

from __future__ import annotations

import argparse
import json
import shlex
import tempfile
import urllib.request
from pathlib import Path

from specbench.engines import llamacpp
from specbench.engines.launch import launched
from specbench.workloads.prompts import load_prompts


def greedy(root: str, prompt: str, tokens: int) -> str:
    body = {"prompt": prompt, "n_predict": tokens, "temperature": 0, "cache_prompt": False}
    request = urllib.request.Request(
        root + "/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())["content"]


def differs_at(a: str, b: str) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None if len(a) == len(b) else 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--spec", required=True, help="llama-server's speculation arguments")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--extra", default="", help="llama-server arguments of both servers")
    args = parser.parse_args()
    server = llamacpp.find_server()
    # As specbench sends it: through the target's chat template (the GGUF's own, from its tokenizer).
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(Path(args.gguf).parent, gguf_file=Path(args.gguf).name)
    messages = [{"role": "user", "content": load_prompts("humaneval", 1)[0].turns[0]}]
    prompt = tokenizer.encode(
        tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), add_special_tokens=False
    )
    plain = llamacpp.command(server, Path(args.gguf), 1, 2048) + " " + args.extra
    answers = {}
    with tempfile.TemporaryDirectory() as logs:
        for name, command in (("plain", plain), ("speculating", f"{plain} {shlex.join(shlex.split(args.spec))}")):
            with launched(name, command, Path(logs), who=f"llama-server {name}") as url:
                answers[name] = [greedy(url.removesuffix("/v1"), prompt, args.tokens) for _ in range(args.repeats)]
    reference = answers["plain"][0]
    for name, texts in answers.items():
        for i, text in enumerate(texts):
            at = differs_at(reference, text)
            said = "equal" if at is None else f"differs from the plain server's first answer at character {at}"
            print(f"{name} request {i + 1}: {said}")


if __name__ == "__main__":
    main()
