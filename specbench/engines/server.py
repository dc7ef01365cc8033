"""Any running server as an engine (--engine server), through its OpenAI-compatible API.

The server decodes; specbench is its client (aiohttp). A request goes to /v1/completions with the
prompt as token ids, the same ids every engine gets (or, with api="chat", to /v1/chat/completions as
messages), streamed, and is timed from the client's side as the in-process vLLM engine times it:
sent, each chunk, the last chunk. Nothing is retried: a retried request's time would not be the
server's. A request that fails (unreachable, HTTP 4xx/5xx, a timeout, a stream that stops before its
answer ends) comes back as a Served with its reason in ``error``.

What the server says of its speculation, from the response itself where it says it: vLLM's
``metrics.speculative_decoding`` (a server started with --per-request-spec-decode-metrics),
llama.cpp's ``timings.draft_n`` / ``draft_n_accepted``, SGLang's ``meta_info.spec_verify_ct``.
``counters()`` reads the server-wide Prometheus counters at /metrics; only their difference over a
block of requests that nothing else shares describes that block (results/serving.py does that).
"""

from __future__ import annotations

import asyncio
import gc
import json
import math
import queue
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from urllib.parse import urlsplit

from specbench.core.errors import SpecbenchError
from specbench.decoding.sampling import Sampling
from specbench.engines import LoopThread, Served, arrivals, margin, request_seed

API_KEY_ENV = "OPENAI_API_KEY"  # where --api-key-env looks by default, as the OpenAI client does
KEEPALIVE_S = 2.0  # seconds an idle connection is kept for the next request (see _open)
STREAM_LINE_BYTES = 1 << 24  # a chunk that echoes a long prompt's ids is one long line
# The speculative-decoding counters of each server, by the prefix before the names vLLM uses
# (num_drafts, num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos).
COUNTER_PREFIXES = ("vllm:spec_decode_", "llamacpp:spec_decode_", "sglang:spec_decode_", "trtllm_spec_decode_")


def root_of(url: str) -> str:
    """The server's address without the API path: where /health and /metrics are."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def unreachable(url: str, timeout: float = 3.0) -> str | None:
    """Why nothing answers at the API ``url`` (its /models) within ``timeout`` seconds, or None when
    something does: any HTTP answer, an error status included (a missing API key is reported later,
    with the status)."""
    try:
        urllib.request.urlopen(url.rstrip("/") + "/models", timeout=timeout).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError) as e:
        return str(getattr(e, "reason", e))
    return None


class Server:
    """A client of one running server; ``name`` is what its rows are called."""

    def __init__(
        self,
        name: str,
        url: str,
        *,
        api: str = "completions",
        api_key: str | None = None,
        timeout_s: float = 600.0,
        encode: Callable[[str], list[int]] | None = None,
        fresh_connections: bool = False,
    ):
        if urlsplit(url).scheme not in ("http", "https"):
            raise SpecbenchError(f"--server {name}={url}: give the API's URL, e.g. http://127.0.0.1:8000/v1")
        self.name, self.url, self.api = name, url.rstrip("/"), api
        self.root = root_of(url)
        # The key goes only into this header: never into a row, a log line or an error.
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.timeout_s = timeout_s
        self.encode = encode  # text to ids, for a server that returns text only
        # A connection per request, for servers that close kept-alive connections under the client:
        # llama-server (cpp-httplib) did, and aiohttp wrote 71 of an audit's 1,000 requests into
        # closed ones ("Can not write request body").
        # On loopback a connection costs microseconds.
        self.fresh_connections = fresh_connections
        self.driver = LoopThread()
        self.session = None
        try:
            self.session = self.driver.wait(self._open())
            self.model = self.driver.wait(self._model())
        except BaseException:
            self.close()
            raise

    async def _open(self):
        import aiohttp

        # No cap on connections (aiohttp's default is 100): _drive's semaphore holds the load at the
        # run's concurrency, and a cap below it would quietly hold it lower. An idle connection is
        # dropped after KEEPALIVE_S, before the server drops it: cpp-httplib and uvicorn close theirs
        # after 5 s, and aiohttp keeps them 15 s by default.
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, force_close=True)
            if self.fresh_connections
            else aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S),
            headers=self.headers,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            read_bufsize=STREAM_LINE_BYTES,
        )

    async def _get(self, path: str, what: str):
        """GET ``path`` under the server's root; one line naming the server when it cannot answer."""
        import aiohttp

        try:
            async with self.session.get(self.root + path) as response:
                if response.status >= 400:
                    raise SpecbenchError(
                        f"the server {self.name} at {self.url} answered {what} with HTTP {response.status}: "
                        "check the URL and the API key (--api-key-env)"
                    )
                return await (response.json() if path.endswith("models") else response.text())
        except (TimeoutError, aiohttp.ClientError, OSError) as e:
            raise SpecbenchError(
                f"the server {self.name} at {self.url} is not reachable ({reason(e)}): start it, or check the URL"
            ) from None

    async def _model(self) -> str:
        """The model the server serves (the first it lists): every request names it."""
        listed = await self._get(urlsplit(self.url).path + "/models", "/models")
        models = [m.get("id") for m in listed.get("data", []) if m.get("id")]
        if not models:
            raise SpecbenchError(f"the server {self.name} at {self.url} lists no model at /models")
        return models[0]

    def body(self, request: list[int] | list[dict], sampling: Sampling, seed: int) -> dict:
        """The request's JSON: the prompt (ids) or messages, with the run's sampling and its own seed."""
        body = {
            "model": self.model,
            "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
            "return_token_ids": True,  # vLLM: the answer's ids, for exact comparison; others ignore it
        }
        body["messages" if self.api == "chat" else "prompt"] = request
        if sampling.top_k > 0:
            body["top_k"] = sampling.top_k
        # The settings beyond OpenAI's own go only where set: vLLM, SGLang and llama.cpp take them.
        extra = {"min_p": (sampling.min_p, 0.0), "repetition_penalty": (sampling.repetition_penalty, 1.0)}
        extra |= {"presence_penalty": (sampling.presence_penalty, 0.0)}
        extra |= {"frequency_penalty": (sampling.frequency_penalty, 0.0)}
        body |= {name: value for name, (value, off) in extra.items() if value != off}
        if sampling.logit_bias:
            body["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias}
        if sampling.logprobs:
            body["logprobs"] = sampling.logprobs if self.api == "completions" else True
            if self.api == "chat":
                body["top_logprobs"] = sampling.logprobs
        if sampling.stop_ids:
            body["stop_token_ids"] = list(sampling.stop_ids)
        if sampling.stop:
            body["stop"] = list(sampling.stop)
        return body

    def run(
        self,
        requests: list,
        concurrency: int,
        sampling: Sampling,
        rate: float = math.inf,
        indices: list[int] | None = None,
    ) -> Iterator[Served]:
        """Send every request, at most ``concurrency`` in flight, arriving at ``rate`` per second;
        yields each as it finishes (or fails).

        While it runs, the objects that existed before it are frozen (gc.freeze), as vLLM's benchmark
        client freezes its own: with torch and transformers imported, a full collection of them
        stopped the thread that times the chunks for up to 0.4 s, which went into ITL and TPOT."""
        seeds = [request_seed(sampling.seed, i) for i in (range(len(requests)) if indices is None else indices)]
        drive = lambda finished: self._drive(requests, concurrency, sampling, rate, seeds, finished)  # noqa: E731
        frozen = gc.get_freeze_count() > 0  # by someone else: theirs to undo
        gc.freeze()
        try:
            yield from self.driver.stream(len(requests), drive, f"the client of {self.name}")
        finally:
            if not frozen:
                gc.unfreeze()

    async def _drive(self, requests, concurrency: int, sampling: Sampling, rate: float, seeds, finished: queue.Queue):
        gate = asyncio.Semaphore(concurrency)
        began = time.perf_counter()

        async def one(index: int, request, at: float) -> None:
            try:
                await asyncio.sleep(at)
                async with gate:
                    finished.put(await self._request(index, self.body(request, sampling, seeds[index]), began))
            except BaseException as e:  # not a failed request but a fault of ours: the caller stops at it
                finished.put(e)

        times = arrivals(len(requests), rate, sampling.seed)
        await asyncio.gather(*(one(i, r, at) for i, (r, at) in enumerate(zip(requests, times, strict=True))))

    async def _request(self, index: int, body: dict, began: float) -> Served:
        import aiohttp

        path = "/chat/completions" if self.api == "chat" else "/completions"
        start = time.perf_counter() - began
        reply = Reply()
        try:
            async with self.session.post(self.url + path, json=body) as response:
                if response.status >= 400:
                    said = (await response.text())[:200].replace("\n", " ")
                    reply.error = f"HTTP {response.status}: {said}"
                else:
                    async for line in response.content:
                        if reply.take(line, time.perf_counter() - began):
                            break
                    if not reply.error and not reply.ended:
                        reply.error = "the stream ended before the answer did"
        except TimeoutError:
            reply.error = f"no complete answer within {self.timeout_s:g} s"
        except aiohttp.ClientPayloadError as e:  # the connection closed mid-answer
            reply.error = f"the stream ended before the answer did ({reason(e)})"
        except (aiohttp.ClientError, OSError) as e:
            reply.error = reason(e)
        end = time.perf_counter() - began
        return reply.served(index, start, end, self.encode)

    def margin_at(self, request: list[int], position: int) -> float | None:
        """How far apart, in log-probability, the server's two likeliest tokens were at ``position`` of
        its greedy answer to ``request`` (token ids); None when it gives no logprobs. Untimed."""
        return self.driver.wait(self._margin(request, position))

    async def _margin(self, request: list[int], position: int) -> float | None:
        import aiohttp

        body = {"model": self.model, "prompt": request, "max_tokens": position + 1, "temperature": 0, "logprobs": 2}
        try:
            async with self.session.post(self.url + "/completions", json=body) as response:
                if response.status >= 400:
                    return None
                reply = await response.json()
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError):
            return None
        tops = top_logprobs((reply.get("choices") or [{}])[0].get("logprobs"))
        return margin(tops[position]) if len(tops) > position else None

    def check(self) -> None:
        """Raise SpecbenchError (one line) when the server no longer answers."""
        self.driver.wait(self._model())

    def counters(self) -> dict[str, float | list[float]]:
        """The server's speculative-decoding counters now (summed over its engines), by vLLM's names
        without the prefix; empty when it has none or no /metrics."""
        try:
            text = self.driver.wait(self._get("/metrics", "/metrics"))
        except SpecbenchError:
            return {}
        return parse_counters(text)

    def close(self) -> None:
        if self.session is not None:
            self.driver.wait(self.session.close())
            self.session = None
        self.driver.close()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Reply:
    """What a streamed response has said so far."""

    def __init__(self) -> None:
        self.text, self.ids, self.times = "", [], []  # times: when each chunk with answer text came
        self.arrivals: list[float] = []  # when each of ``ids`` came
        self.usage, self.spec, self.timings, self.meta = None, None, None, None
        self.ended, self.error = False, ""
        self.logprobs: list[list[float]] = []  # per position, the likeliest tokens' log-probabilities

    def take(self, line: bytes, now: float) -> bool:
        """Read one line of the event stream; True when the stream is done."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            self.ended = True
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            self.error = str(error.get("message", error) if isinstance(error, dict) else error)[:200]
            return True
        for choice in chunk.get("choices") or []:
            piece = choice.get("text") or (choice.get("delta") or {}).get("content") or ""
            ids = choice.get("token_ids") or []
            if piece or ids:
                self.times.append(now)
            self.text += piece
            self.ids += ids
            self.arrivals += [now] * len(ids)
            tops = top_logprobs(choice.get("logprobs"))
            # A token streamed without logprobs keeps its place (an empty list), so that the
            # positions after it stay aligned: llama-server sends null for every token of a
            # speculative round.
            self.logprobs += tops or [[]] * (len(ids) or (1 if piece else 0))
            self.ended = self.ended or bool(choice.get("finish_reason"))
        self.usage = chunk.get("usage") or self.usage
        self.spec = (chunk.get("metrics") or {}).get("speculative_decoding") or self.spec  # vLLM
        self.timings = chunk.get("timings") or self.timings  # llama.cpp
        self.meta = chunk.get("meta_info") or self.meta  # SGLang
        return False

    def served(self, index: int, start: float, end: float, encode) -> Served:
        tokens = self.ids or (encode(self.text) if encode and self.text else [])
        first = self.times[0] if self.times else end
        itl = [b - a for a, b in zip(self.times, self.times[1:], strict=False)]
        served = Served(index, tokens, start, first, end, None, itl=itl, text=self.text, error=self.error)
        served.encoded = not self.ids
        served.arrivals = self.arrivals if self.ids else None
        served.logprobs = self.logprobs if any(self.logprobs) else None
        count = (self.usage or {}).get("completion_tokens")
        if count is not None and not self.ids:  # the server's count, when its ids were not given
            served.reported = count
        if self.spec:  # vLLM: the histogram of accepted drafts per verify step
            served.histogram = list(self.spec["acceptance_histogram"])
            served.drafted, served.k = self.spec["num_draft_tokens"], self.spec.get("num_spec_tokens")
            if self.spec.get("per_step_drafted"):
                served.steps = list(zip(self.spec["per_step_drafted"], self.spec["per_step_accepted"], strict=True))
                served.rejected = sum(1 for drafted, accepted in served.steps if accepted < drafted)
        elif self.timings and "draft_n" in self.timings:  # llama.cpp
            served.drafted, served.accepted = self.timings["draft_n"], self.timings["draft_n_accepted"]
        elif self.meta and "spec_verify_ct" in self.meta:  # SGLang: a target forward per verify
            served.accepted = (count or len(tokens)) - self.meta["spec_verify_ct"]
        return served


def top_logprobs(logprobs: dict | None) -> list[list[float]]:
    """Per position of a chunk, the likeliest tokens' log-probabilities, best first: from a completion's
    ``top_logprobs`` (a dict per position) or a chat answer's ``content`` (a list per position)."""
    if not logprobs:
        return []
    if "content" in logprobs:  # chat
        return [
            sorted((t["logprob"] for t in pos.get("top_logprobs") or [pos]), reverse=True)
            for pos in logprobs["content"] or []
        ]
    return [sorted((pos or {}).values(), reverse=True) for pos in logprobs.get("top_logprobs") or []]


def parse_counters(text: str) -> dict[str, float | list[float]]:
    """Speculative-decoding counters from a Prometheus exposition, summed over label sets (one per
    engine under data parallelism), by name without server prefix or _total; the per-position
    counter becomes a list by position."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[str, float | list[float]] = {}
    by_position: dict[int, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            prefix = next((p for p in COUNTER_PREFIXES if sample.name.startswith(p)), None)
            if prefix is None or family.type not in ("counter", "unknown") or sample.name.endswith("_created"):
                continue  # _created: when the series began
            if "position" in sample.labels:
                position = int(sample.labels["position"])
                by_position[position] = by_position.get(position, 0.0) + sample.value
            else:
                name = sample.name.removeprefix(prefix).removesuffix("_total")
                found[name] = found.get(name, 0.0) + sample.value
    if by_position:
        found["num_accepted_tokens_per_pos"] = [by_position.get(p, 0.0) for p in range(max(by_position) + 1)]
    return found


def reason(e: BaseException) -> str:
    """Why a connection failed, in a line that carries no header (so no key)."""
    said = str(e).splitlines()[0] if str(e) else ""
    return f"{type(e).__name__}: {said}" if said else type(e).__name__
