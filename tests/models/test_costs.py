"""What a decode step reads, and the copy bandwidth it is judged against (models/costs.py)."""

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
