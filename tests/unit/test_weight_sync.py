"""The packing plan, and a real gloo group (two threads over a TCPStore) moving weights."""

import threading

import torch

from tests.weight_sync_helpers import send_weights
from verl_async.protocol import ParamSpec
from verl_async.weight_sync import (
    join_group,
    param_specs,
    plan_buckets,
    receive_weights,
)


def test_plan_packs_in_order_aligned_and_splits_large():
    specs = [
        ParamSpec("a", "float32", (3,)),
        ParamSpec("b", "float32", (10,)),
        ParamSpec("c", "float32", (100,)),
    ]
    buckets = plan_buckets(specs, bucket_bytes=64)
    assert [[s.name for s in b.specs] for b in buckets] == [["a", "b"], ["c"]]
    assert buckets[0].offsets == [0, 16]  # 12 bytes padded to 16
    assert buckets[1].nbytes == 400  # larger than a bucket: alone


def test_gloo_broadcast_roundtrip(free_port):
    port = free_port()
    torch.manual_seed(0)
    tensors = {"w": torch.randn(5, 7), "b": torch.randn(7), "h": torch.randn(3).to(torch.bfloat16)}
    specs = param_specs(tensors.items())
    got = {}

    def receiver():
        group = join_group("127.0.0.1", port, 1, 2, "gloo", 30)
        for bucket in receive_weights(group, specs, 64, torch.device("cpu")):
            got.update({n: t.clone() for n, t in bucket})

    thread = threading.Thread(target=receiver)
    thread.start()
    group = join_group("127.0.0.1", port, 0, 2, "gloo", 30)
    sent = send_weights(group, tensors, specs, 64)
    thread.join(timeout=30)
    assert sent > 0 and set(got) == set(tensors)
    for name, t in tensors.items():
        assert got[name].dtype == t.dtype
        assert torch.equal(got[name], t)
