"""What a decode step reads, and the copy bandwidth it is judged against (models/costs.py)."""

import pytest
import torch

from specbench.models.costs import copy_bandwidth, streamed_bytes
from specbench.models.load import load

CPU, F32 = torch.device("cpu"), torch.float32


def test_a_step_reads_every_weight_once_and_one_row_of_an_untied_embedding(tiny_pair, untied_target):
    tied, untied = load(tiny_pair[0], CPU, F32).model, load(untied_target, CPU, F32).model
    every = sum(p.numel() for p in untied.parameters()) * 4
    embedding = untied.get_input_embeddings().weight
    weights, kv = streamed_bytes(untied)
    assert weights == every - embedding.numel() * 4 + embedding.shape[1] * 4  # the head whole, the embedding a row
    # Tied, the head is the embedding: read whole, once (the two models differ only there).
    assert streamed_bytes(tied)[0] == sum(p.numel() for p in tied.parameters()) * 4 == every - embedding.numel() * 4
    # A key and a value per layer and key/value head: 4 layers x 2 heads x 16 dims, float32.
    assert kv == 2 * 4 * 2 * 16 * 4
    assert streamed_bytes(tied.to(torch.bfloat16)) == (weights // 2 - embedding.shape[1] * 2, kv // 2)


def test_the_copy_bandwidth_is_measured_on_the_device():
    bandwidth = copy_bandwidth(CPU, repeats=3)
    assert 1e8 < bandwidth < 1e13  # bytes per second: above 100 MB/s, below 10 TB/s


@pytest.mark.gpu
def test_on_cuda_a_copy_is_timed_by_the_device_not_around_host_waits():
    # Events on the copy's stream: a host timer around two synchronisations times more than the copy.
    from specbench.models.costs import copy_seconds, seconds_of

    cuda = torch.device("cuda")
    source = torch.ones(2**28, dtype=torch.uint8, device=cuda)
    target = torch.empty_like(source)
    for _ in range(3):
        copy_seconds(cuda, target, source)
    by_events = sorted(copy_seconds(cuda, target, source) for _ in range(9))[4]
    by_host = sorted(seconds_of(cuda, lambda: target.copy_(source)) for _ in range(9))[4]
    assert 0 < by_events < by_host
    assert 1e11 < 2 * source.numel() / by_events < 2e13  # bytes per second: a GPU's, read and written
