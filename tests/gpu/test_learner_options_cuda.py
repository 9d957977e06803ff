"""learner.cpu_offload on one CUDA rank (tests/unit/test_learner_options.py runs the same
steps on CPU): shards, gradients and AdamW state in pinned host memory, each layer's
compute on the GPU, the process group NCCL for CUDA tensors and gloo for host ones."""

import pytest
import torch

from tests.unit.test_learner_options import offload_report

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cpu_offload_on_one_cuda_rank_trains_as_the_plain_model(tmp_path):
    """The plain model steps AdamW on the GPU, the offloaded one on the CPU: the same
    gradients (the same CUDA kernels compute both), updates that differ by the two
    AdamW kernels' rounding, so 1e-5 after four steps of lr 1e-3. The resumed run takes
    the offloaded run's own path: bit for bit."""
    report = offload_report(tmp_path, "cuda")
    assert report["offloaded"] == ["cpu"]
    assert report["sent_from"] == ["cuda"]  # gathered in host memory, sent from the GPU
    assert report["moved"] > 1e-3
    assert report["max_abs_diff"] <= 1e-5, report
    assert report["published_max_abs_diff"] <= 1e-5, report
    assert report["resumed_max_abs_diff"] == 0.0, report
