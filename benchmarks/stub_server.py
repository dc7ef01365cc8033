"""An OpenAI-compatible stub server for the tests of --engine server: on 127.0.0.1, a free port, in a
thread, started and stopped by the test. It answers like vLLM, llama.cpp, SGLang or TensorRT-LLM
(``shape``), streams an answer that depends only on the prompt, and can misbehave on purpose.

The answer to a prompt is a fixed function of its ids, so a baseline stub and a speculating stub
agree token for token unless ``diverge_at`` says otherwise. A speculating stub (k > 0) pretends to
verify K drafts a step, accepting step % (K + 1) of them, and streams each step's tokens as one
chunk: its per-request figures and its /metrics counters are exact for that pretence.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading

from aiohttp import web

PREFIX = {"vllm": "vllm:spec_decode_", "trtllm": "trtllm_spec_decode_"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer(prompt: list[int], max_tokens: int) -> list[int]:
    """What every stub generates for a prompt: ids 3..99, a function of the prompt alone."""
    seed = sum(prompt) * 7 + len(prompt)
    return [(seed + 13 * i) % 97 + 3 for i in range(max_tokens)]


def steps_of(tokens: int, k: int) -> list[int]:
    """Accepted drafts of each verify step until ``tokens`` are out (step i accepts i % (K + 1))."""
    accepted, out, i = [], 0, 0
    while out < tokens:
        took = min(i % (k + 1), tokens - out - 1)
        accepted.append(took)
        out += took + 1
        i += 1
    return accepted


class Stub:
    def __init__(
        self,
        shape: str = "vllm",
        k: int = 0,
        interval_s: float = 0.0,
        diverge_at: int | None = None,
        fault: str = "",
        key: str | None = None,
        die_after: int | None = None,
        model: str = "stub-model",
        margin: float = 1.0,
    ):
        self.shape, self.k, self.interval_s, self.diverge_at = shape, k, interval_s, diverge_at
        self.fault, self.key, self.die_after, self.model = fault, key, die_after, model
        self.margin = margin  # the gap between its two likeliest tokens, in nats, wherever logprobs are asked
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.handled = 0
        self.bodies: list[dict] = []  # every completion request's JSON, as received
        self.counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self.per_pos = [0] * k
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)

    def __enter__(self) -> Stub:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/v1/completions", self.complete)
        app.router.add_post("/v1/chat/completions", self.complete)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    @property
    def dead(self) -> bool:
        """Whether it plays a server that died: past ``die_after`` requests, every connection drops."""
        return self.die_after is not None and self.handled > self.die_after

    def _refused(self, request: web.Request) -> web.Response | None:
        if self.key is not None and request.headers.get("Authorization") != f"Bearer {self.key}":
            return web.json_response({"error": {"message": "invalid API key"}}, status=401)
        return None

    async def models(self, request: web.Request) -> web.Response:
        if self.dead:
            request.transport.close()
            return web.Response()
        return self._refused(request) or web.json_response({"data": [{"id": self.model, "object": "model"}]})

    async def metrics(self, request: web.Request) -> web.Response:
        if self.shape not in PREFIX:
            return web.Response(status=404)
        lines = []
        for name, value in self.counters.items():
            full = PREFIX[self.shape] + name
            lines += [f"# TYPE {full}_total counter", f'{full}_total{{engine="0"}} {value}']
        full = PREFIX[self.shape] + "num_accepted_tokens_per_pos"
        lines.append(f"# TYPE {full}_total counter")
        lines += [f'{full}_total{{engine="0",position="{p}"}} {n}' for p, n in enumerate(self.per_pos)]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def complete(self, request: web.Request) -> web.StreamResponse:
        if refused := self._refused(request):
            return refused
        self.handled += 1
        if self.dead:
            request.transport.close()  # as a server that died: the connection drops
            return web.Response()
        body = await request.json()
        self.bodies.append(body)
        if self.fault == "http500":
            return web.json_response({"error": {"message": "internal error"}}, status=500)
        if self.fault == "slow":
            await asyncio.sleep(5)  # past the test's --request-timeout
        prompt = body.get("prompt") or [len(json.dumps(body["messages"]))]
        tokens = answer(prompt, body["max_tokens"])
        if self.diverge_at is not None and self.diverge_at < len(tokens):
            tokens[self.diverge_at] += 1
        if not body.get("stream"):  # asked for logprobs, untimed: its two likeliest tokens at each position
            tops = [{f" w{t}": -0.01, " other": -0.01 - self.margin} for t in tokens]
            choice = {"index": 0, "text": "".join(f" w{t}" for t in tokens), "logprobs": {"top_logprobs": tops}}
            return web.json_response({"choices": [choice]})
        steps = steps_of(len(tokens), self.k) if self.k else [0] * len(tokens)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        out = 0
        for n, took in enumerate(steps):
            if self.fault == "drop" and n == len(steps) // 2:
                request.transport.close()
                return response
            await asyncio.sleep(self.interval_s)
            piece = tokens[out : out + took + 1]
            out += len(piece)
            choice = {"index": 0, "text": "".join(f" w{t}" for t in piece), "finish_reason": None}
            if "messages" in body:
                choice = {"index": 0, "delta": {"content": choice["text"]}, "finish_reason": None}
            if self.shape == "vllm" and body.get("return_token_ids"):
                choice["token_ids"] = piece
            if out == len(tokens):
                choice["finish_reason"] = "length"
            await self._send(response, {"choices": [choice]})
        final = {"choices": [], "usage": {"completion_tokens": len(tokens), "prompt_tokens": len(prompt)}}
        final.update(self._speculation(steps, len(tokens)))
        await self._send(response, final)
        await response.write(b"data: [DONE]\n\n")
        return response

    def _speculation(self, steps: list[int], tokens: int) -> dict:
        """What this shape says of the request's speculation, and the counters it adds to."""
        if not self.k:
            return {}
        self.counters["num_drafts"] += len(steps)
        self.counters["num_draft_tokens"] += self.k * len(steps)
        self.counters["num_accepted_tokens"] += sum(steps)
        for took in steps:
            for p in range(took):
                self.per_pos[p] += 1
        if self.shape == "vllm":
            histogram = [sum(1 for took in steps if took == n) for n in range(self.k + 1)]
            spec = {
                "acceptance_histogram": histogram,
                "num_spec_steps": len(steps),
                "num_accepted_draft_tokens": sum(steps),
                "num_draft_tokens": self.k * len(steps),
                "num_spec_tokens": self.k,
                "mean_acceptance_length": 1 + sum(steps) / len(steps),
                "draft_acceptance_rate": sum(steps) / (self.k * len(steps)),
            }
            return {"metrics": {"speculative_decoding": spec}}
        if self.shape == "llamacpp":
            return {"timings": {"draft_n": self.k * len(steps), "draft_n_accepted": sum(steps)}}
        if self.shape == "sglang":
            return {"meta_info": {"spec_verify_ct": len(steps), "completion_tokens": tokens}}
        return {}

    @staticmethod
    async def _send(response: web.StreamResponse, obj: dict) -> None:
        await response.write(f"data: {json.dumps(obj)}\n\n".encode())
