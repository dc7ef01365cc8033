"""An OpenAI-compatible stub server, for the tests of --engine server and for the client-overhead
benchmark (client_overhead.py): on 127.0.0.1, a free port, in a thread that the test starts and
stops, or in a process of its own (``python benchmarks/stub_server.py --help``). It answers like vLLM,
llama.cpp, SGLang or TensorRT-LLM (``shape``), streams an answer that depends only on the prompt, and
can misbehave on purpose.

The answer to a prompt is a fixed function of its ids, so a baseline stub and a speculating stub
agree token for token unless ``diverge_at`` says otherwise. A speculating stub (k > 0) pretends to
verify K drafts a step, accepting step % (K + 1) of them, and streams each step's tokens as one
chunk: its per-request figures and its /metrics counters are exact for that pretence.

A recording stub (``record=True``) notes when it sent each chunk of answer (time.perf_counter, taken
just before the write), and begins each answer's text with ``#N`` (N: the request's number, from 0
in the order received) so that a client's record of the request can be matched with the stub's.
``GET /stub/sent`` returns ``{"N": [send times, s]}`` for the requests finished since the last call,
and forgets them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
import threading
import time

from aiohttp import web

PREFIX = {"vllm": "vllm:spec_decode_", "trtllm": "trtllm_spec_decode_"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def answer(prompt: list[int] | str, max_tokens: int) -> list[int]:
    """What every stub generates for a prompt (ids, or text as `vllm bench serve` sends it): ids 3..99,
    a function of the prompt alone."""
    if isinstance(prompt, str):
        prompt = list(prompt.encode())
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
        record: bool = False,
        port: int | None = None,
        gather: int = 0,
    ):
        self.shape, self.k, self.interval_s, self.diverge_at = shape, k, interval_s, diverge_at
        self.fault, self.key, self.die_after, self.model = fault, key, die_after, model
        self.margin = margin  # the gap between its two likeliest tokens, in nats, wherever logprobs are asked
        self.record = record
        # With gather=N, each answer waits (up to 10 s) until N are being answered at once; peak: the
        # most it has answered at once.
        self.gather, self.streaming, self.peak = gather, 0, 0
        self.gathered: asyncio.Event | None = None
        self.sent: dict[int, list[float]] = {}  # a recording stub's send times of finished requests
        self.port = port if port is not None else free_port()
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
        app.router.add_get("/stub/sent", self.take_sent)
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
        return self._refused(request) or web.json_response(
            {"data": [{"id": self.model, "object": "model", "root": self.model}]}  # root: as vLLM lists it
        )

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
        serial = self.handled
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
        self.streaming += 1
        try:
            await self._gather()
            return await self._stream(request, response, body, prompt, tokens, steps, serial)
        finally:
            self.streaming -= 1

    async def _gather(self) -> None:
        self.peak = max(self.peak, self.streaming)
        if not self.gather:
            return
        self.gathered = self.gathered or asyncio.Event()
        if self.streaming >= self.gather:
            self.gathered.set()
        try:
            await asyncio.wait_for(self.gathered.wait(), 10)
        except TimeoutError:
            pass

    async def _stream(self, request, response, body, prompt, tokens, steps, serial) -> web.StreamResponse:
        """Stream the answer, one chunk per (pretended) verify step, ``interval_s`` before each."""
        out, sent = 0, []
        for n, took in enumerate(steps):
            if self.fault == "drop" and n == len(steps) // 2:
                request.transport.close()
                return response
            await asyncio.sleep(self.interval_s)
            piece = tokens[out : out + took + 1]
            out += len(piece)
            text = "".join(f" w{t}" for t in piece)
            if self.record and n == 0:
                text = f"#{serial}" + text
            choice = {"index": 0, "text": text, "finish_reason": None}
            if "messages" in body:
                choice = {"index": 0, "delta": {"content": choice["text"]}, "finish_reason": None}
            if self.shape == "vllm" and body.get("return_token_ids"):
                choice["token_ids"] = piece
            if out == len(tokens):
                choice["finish_reason"] = "length"
            data = self._encode({"choices": [choice]})
            if self.record:
                sent.append(time.perf_counter())
            await response.write(data)
        if self.record:
            self.sent[serial] = sent
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

    async def take_sent(self, request: web.Request) -> web.Response:
        """A recording stub's send times of the requests finished since the last call, by number."""
        sent, self.sent = self.sent, {}
        return web.json_response({str(serial): times for serial, times in sent.items()})

    @staticmethod
    def _encode(obj: dict) -> bytes:
        return f"data: {json.dumps(obj)}\n\n".encode()

    @classmethod
    async def _send(cls, response: web.StreamResponse, obj: dict) -> None:
        await response.write(cls._encode(obj))


def main(argv: list[str] | None = None) -> None:
    """Serve in this process until SIGTERM or SIGINT; the first line on stdout is the API's URL."""
    parser = argparse.ArgumentParser(description="An OpenAI-compatible stub server on 127.0.0.1, in this process.")
    parser.add_argument("--port", type=int, default=0, help="the port (default: a free one)")
    parser.add_argument("--interval-ms", type=float, default=10.0, help="the pause before each chunk, ms")
    parser.add_argument("--shape", default="vllm", choices=["vllm", "llamacpp", "sglang", "trtllm"])
    parser.add_argument("--k", type=int, default=0, help="drafts per verify step it pretends (0: one token a chunk)")
    parser.add_argument("--record", action="store_true", help="record each chunk's send time (GET /stub/sent)")
    args = parser.parse_args(argv)
    stub = Stub(args.shape, k=args.k, interval_s=args.interval_ms / 1000, record=args.record, port=args.port or None)
    loop = stub.loop
    asyncio.set_event_loop(loop)
    loop.run_until_complete(stub._start())
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, loop.stop)
    print(stub.url, flush=True)
    try:
        loop.run_forever()
    finally:
        loop.run_until_complete(stub.runner.cleanup())
        loop.close()


if __name__ == "__main__":
    main()
