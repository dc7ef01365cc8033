"""What a graphed forward of the static path costs the host, measured on a CPU: the Python and the
operations around one CUDA graph replay, the replay itself removed.

On a GPU a draft step's wall time is at least the host's time to queue it. The mission's 68M draft
reads its weights in about 30 us on an H200, and c <= 0.03 leaves it about 130 us against a 7B step
at the bandwidth limit; so the host's share has to be a fraction of that. Here a tiny Llama on the
static path takes the CUDA route with each graph's replay made a no-op: what is timed is everything
a forward does besides the replay (copying its ids in, the first slot's fill, the output's copy, the
LM head, the loop's bookkeeping), and each operation dispatched is one kernel launch on CUDA.

    python -m benchmarks.graph_host_cost --repeats 7
    python -m benchmarks.graph_host_cost --repeats 7 --vocab 512 --shortlist 128   # a shortlisted head
    python -m benchmarks.graph_host_cost --repeats 7 --eagle   # an EAGLE head drafts instead
    python -m benchmarks.graph_host_cost --repeats 7 --eagle --dynamic 10,4   # its EAGLE-2 dynamic trees

Each repeat times --forwards one-token forwards (each followed by dropping its position again); the
figure is the median over repeats, on one thread. Then a whole greedy speculative round at --k: that
model drafts, one of its shape with the whole vocabulary verifies (the draft's catch-up forward, its
chain of K as one graph, StaticLM.draft_chain, a verification of K + 1, the acceptance test, the
round's one host read); its host time per round is the median over --repeats decodes. No replay writes
new outputs, so what is accepted is whatever the captures left: the line says how much.

With --eagle an EAGLE-3 head of the model's width (taps 0, 1 and 1, its whole vocabulary) drafts
from the target's features on the static path (models/static_head.StaticHead), its replays removed
too: a one-token step is the head reading its last draft and scoring the next (the drafter's
chain step), and a round is a greedy EAGLE round at --k (the head's read of the round's pairs, K - 1
chain steps, the target's verification with its features, the acceptance test); with --dynamic, a
round of EAGLE-2's dynamic trees of K levels (the head's read of the round's pairs, K - 1 levels
each read in one step, the tree's choice on the device, the target's verification of its nodes).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from pathlib import Path

import torch

from specbench.decoding.decode import speculative_decode
from specbench.decoding.sampling import Sampling
from specbench.drafters.eagle import EagleDrafter
from specbench.drafters.model import ModelDrafter
from specbench.models import lm as lm_module
from specbench.models import static
from specbench.models.static_head import StaticHead
from tests.helpers import Dispatched, build_eagle3_head


class NoReplay(static.Graph):
    """A graph whose capture runs the forward once (for its output tensors) and whose replay does nothing."""

    def capture(self, run, pool):
        return run(*self.buffers)

    def replay(self) -> None:
        pass


def graphed_lm(width: int, vocab: int, shortlist: int = 0, taps: tuple[int, ...] | None = None) -> static.StaticLM:
    """A 2-layer Llama of ``width`` and ``vocab`` on the static path's CUDA route, replays removed; with
    ``shortlist``, its head scores that many ids (every other one) and what it reads, as a shortlisted
    draft does on CUDA (lm.ShortlistedHead: no host read to skip the appending); with ``taps``, its
    forwards record those layers' inputs (an EAGLE head's target)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=2 * width, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=2048,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    static.Graph = NoReplay
    static.compile_forms = lambda one, many, *_: (one, many)  # the forms are never run but at capture
    head_tokens = torch.arange(0, 2 * shortlist, 2) if shortlist else None
    if shortlist:
        lm_module.host_reads_free = lambda device: False
    lm = static.StaticLM.of(model, vocab, head_tokens)
    lm.graphed = True
    lm.reserve(1024, taps=taps)
    lm.record_features(taps)
    return lm


def graphed_head(target: static.StaticLM, taps: tuple[int, ...], scratch: Path) -> StaticHead:
    """An EAGLE-3 head of random weights for ``target``, reading ``taps``, on the static path's CUDA
    route, replays removed (graphed_lm made them no-ops)."""
    from specbench.models.eagle_head import read_head

    config = target.model.config
    path = build_eagle3_head(scratch / "head", config, taps=taps)
    embed = target.model.get_input_embeddings().weight
    head = StaticHead(read_head(path, embed, config.num_hidden_layers, config.hidden_size, config.vocab_size), 1024)
    head.graphed = True
    head.reserve(1024)
    return head


def median_us(step, repeats: int, steps: int) -> tuple[float, list[float]]:
    """Microseconds per call of ``step``: the median over ``repeats`` of ``steps`` calls, and each."""
    times = []
    for _ in range(repeats):
        began = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - began) / steps * 1e6)
    return statistics.median(times), times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--forwards", type=int, default=500, help="one-token forwards per repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--width", type=int, default=64, help="the tiny model's width (its LM head runs)")
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument(
        "--shortlist", type=int, default=0, help="ids the head scores (every other one; 0: the whole vocabulary)"
    )
    parser.add_argument("--eagle", action="store_true", help="an EAGLE head drafts (its chain steps are timed)")
    parser.add_argument(
        "--dynamic",
        default=None,
        help="with --eagle, the rounds draft EAGLE-2's dynamic trees of NODES,WIDTH (e.g. 10,4)",
    )
    parser.add_argument("--k", type=int, default=4, help="draft length of the timed speculative rounds")
    parser.add_argument("--new-tokens", type=int, default=600, help="tokens each timed decode generates")
    args = parser.parse_args()
    torch.set_num_threads(1)
    greedy, generator, prompt = Sampling(temperature=0.0), torch.Generator().manual_seed(0), torch.arange(3, 40)
    with tempfile.TemporaryDirectory() as scratch, torch.inference_mode():
        if args.eagle:
            taps = (0, 1, 1)
            target = graphed_lm(args.width, args.vocab, taps=taps)
            head = graphed_head(target, taps, Path(scratch))
            cache = head.new_cache()
            features = torch.zeros(len(prompt), head.config.hidden)
            head.scored_step(prompt, features, cache)  # the prompt's pairs, uncaptured
            out, token = features[-1:], torch.tensor([5])

            def one_step():  # the drafter's chain step: read the last draft, score the next
                head.scored_step(head.draft_ids[token], out, cache)
                cache.crop(cache.length - 1)

            dynamic = tuple(int(n) for n in args.dynamic.split(",")) if args.dynamic else None

            def drafter():
                return EagleDrafter(head, target, args.vocab, greedy, generator, dynamic=dynamic)

        else:
            lm = graphed_lm(args.width, args.vocab, args.shortlist)
            lm.forward(prompt)  # a prompt, uncompiled
            target, token = graphed_lm(args.width, args.vocab), torch.tensor([5])

            def one_step():
                lm.forward(token)
                lm.keep([], 1)

            def drafter():
                return ModelDrafter(lm, greedy, generator)

        with Dispatched() as dispatched:
            one_step()
        step_us, times = median_us(one_step, args.repeats, args.forwards)

        def decode():
            return speculative_decode(target, drafter(), prompt, args.k, args.new_tokens, greedy, generator)

        decode()  # untimed: the first forwards of each count
        with Dispatched() as in_decode:
            result = decode()
        rounds = len(result.accept_counts)
        round_us, _ = median_us(decode, args.repeats, 1)
    what = "an EAGLE head's graphed chain step" if args.eagle else "a graphed one-token forward"
    ops = ", ".join(f"{name} {n}" for name, n in dispatched.ops.most_common())
    print(f"{platform.processor() or platform.machine()}, torch {torch.__version__}, one thread")
    print(
        f"host time of {what}, its replay removed: {step_us:.1f} us (median of {args.repeats}: {', '.join(f'{t:.1f}' for t in times)})"
    )
    print(f"operations dispatched besides the replay: {sum(dispatched.ops.values())} ({ops})")
    accepted = sum(result.accept_counts) / rounds
    rounds_of = f"EAGLE-2's dynamic trees of {args.dynamic} (nodes, width), " if args.dynamic else ""
    print(
        f"host time of a greedy speculative round at K = {args.k} ({rounds_of}{accepted:.1f} drafts accepted a round, "
        f"the prompt's forwards included): {round_us / rounds:.0f} us "
        f"(median of {args.repeats} decodes of {rounds} rounds); "
        f"{sum(in_decode.ops.values()) / rounds:.0f} operations dispatched a round"
    )


if __name__ == "__main__":
    main()
