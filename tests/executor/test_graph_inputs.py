"""`DecodeGraphs.replay`: the rows' attention metadata reaches the graph's static inputs as
`run` takes them (padding included), checked on a CPU with the capture stubbed out."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from executor.graphs import DecodeGraphs
from executor.model import AttnMetadata


def test_replay_copies_the_metadata_into_the_graph_inputs(monkeypatch):
    graphs = DecodeGraphs(
        SimpleNamespace(device=torch.device("cpu")),
        [],
        [],
        max_seqs=4,
        max_blocks_per_seq=128,
        max_rows=8,
    )
    output = torch.arange(8 * 3, dtype=torch.float32).reshape(8, 3)
    captured = []

    def capture(bucket, width, max_q_len=1):
        captured.append((bucket, width, max_q_len))
        graphs.graphs[(bucket, width, max_q_len)] = (SimpleNamespace(replay=lambda: None), output)

    monkeypatch.setattr(graphs, "capture", capture)
    meta = AttnMetadata(
        positions=torch.tensor([7, 8, 9, 3, 4], dtype=torch.int64),
        slot_mapping=torch.tensor([17, 18, 19, 33, 34], dtype=torch.int64),
        cu_q_lens=torch.tensor([0, 3, 5], dtype=torch.int32),
        seq_lens=torch.tensor([10, 5], dtype=torch.int32),
        block_tables=torch.tensor([[1, 2], [3, 4]], dtype=torch.int32),
        max_q_len=3,
    )
    ids = torch.tensor([11, 12, 13, 14, 15], dtype=torch.int64)
    out = graphs.replay(8, ids, meta)
    assert captured == [(8, 64, 4)]  # 3 rows per sequence: the power-of-two graph of 4
    assert torch.equal(out, output[:5])
    assert graphs.input_ids[:5].tolist() == ids.tolist()
    assert graphs.positions[:5].tolist() == [7, 8, 9, 3, 4]
    assert graphs.slot_mapping.tolist() == [17, 18, 19, 33, 34, -1, -1, -1]
    assert graphs.cu_q_lens.tolist() == [0, 3, 5, 5, 5]
    assert graphs.seq_lens.tolist() == [10, 5, 0, 0]
    assert graphs.block_tables[:2, :2].tolist() == [[1, 2], [3, 4]]
    # an explicit bound replaces the metadata's
    graphs.replay(8, ids, meta, max_q_len=1)
    assert captured[-1] == (8, 64, 1)
