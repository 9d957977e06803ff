"""What benchmarks/gpu.py measures of a learner step besides its wall time: the FLOPs the
step needs (for MFU), device time per phase from CUDA events, the garbage collector's
time, and one step's kernel launches and host and device time under torch.profiler.

**FLOPs of one update** (``step_flops``). A matrix product of an [n, k] by a [k, m]
matrix takes 2·n·k·m FLOPs. Per token, a weight matrix of P parameters costs 2·P in the
forward and 4·P in the backward (the gradients of the input and of the weight): 6·P.
Only the matrices of ``nn.Linear`` layers count: the input embedding is a lookup, norms
are elementwise. The output head counts on response tokens only (the log-prob pass
slices the hidden states to them before the head). With LoRA the frozen weights get no
weight gradient: 4·P (the adapters' own share is left out, under 1 %).

Attention has no parameters but two products per layer: Q·Kᵀ and the weights times V.
With ``d`` = heads × head size (the width of Q), a query at position i (from 0) of a
causal row sees i + 1 keys, so a row of S tokens has S(S+1)/2 query-key pairs, each
costing 2·d FLOPs in Q·Kᵀ and 2·d in the product with V: 2·d·S(S+1) per layer in the
forward, about half of the 4·d·S² a non-causal count gives. The backward takes twice
the forward (two products per forward product: the gradients of both operands), so
forward + backward is 6·d·S(S+1) per layer. A flash kernel's recomputation of Q·Kᵀ in
the backward is not counted (MFU counts the model's work, not a kernel's). Key-value
heads shared by several query heads (GQA) change nothing here: every query head still
meets every key it sees.

The update runs the pi_prox pass (forward only, no gradient) over the rows of every
minibatch but the first, then forward and backward over every row: with k minibatches,
(k - 1)/k of a forward more.

``old_step_flops`` is the figure the benchmark reported before (all parameters but the
head, the input embedding included, at 6 per token; no attention), kept beside the new
one so earlier runs can be compared.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from learners.update import clock_mark, seconds_between


@dataclass
class ModelShape:
    """The sizes the FLOP count needs, read from a built model."""

    matrix_params: int  # nn.Linear weights but the head's (and LoRA adapters')
    head_params: int
    embedding_params: int
    all_params: int
    layers: int
    attn_width: int  # heads x head size: the width of Q

    @classmethod
    def of(cls, model, config) -> ModelShape:
        inner = getattr(model, "module", model)
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        head = inner.get_output_embeddings()
        matrix = sum(
            m.weight.numel()  # the global size under FSDP2 (a DTensor)
            for name, m in inner.named_modules()
            if isinstance(m, torch.nn.Linear) and m is not head and "lora_" not in name
        )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // (
            config.num_attention_heads
        )
        return cls(
            matrix_params=matrix,
            head_params=head.weight.numel(),
            embedding_params=inner.get_input_embeddings().weight.numel(),
            all_params=sum(p.numel() for p in inner.parameters()),
            layers=config.num_hidden_layers,
            attn_width=config.num_attention_heads * head_dim,
        )


def step_flops(
    shape: ModelShape, row_tokens: list[int], response_tokens: int, minibatches: int, lora: bool
) -> float:
    """FLOPs of one update over rows of ``row_tokens`` real tokens each (module docstring)."""
    tokens = sum(row_tokens)
    per_weight = 4 if lora else 6
    prox = (minibatches - 1) / minibatches  # the pi_prox pass: a forward of that share
    weights = shape.matrix_params * tokens + shape.head_params * response_tokens
    attention_fwd = shape.layers * sum(2 * shape.attn_width * s * (s + 1) for s in row_tokens)
    return (per_weight + 2 * prox) * weights + (3 + prox) * attention_fwd


def old_step_flops(
    shape: ModelShape, tokens: int, response_tokens: int, minibatches: int, lora: bool
) -> float:
    """The benchmark's former count: every parameter but the head (the input embedding
    included) as a matrix at every token, no attention."""
    per_token = (4 if lora else 6) + 2 * (minibatches - 1) / minibatches
    body = shape.all_params - shape.head_params
    return per_token * (body * tokens + shape.head_params * response_tokens)


PHASES = ("prox", "forward", "backward", "optimizer")


@dataclass
class PhaseTimer:
    """Device seconds of each phase of a step: events recorded on the current stream
    around the model's forward passes (``prox`` without gradient, ``forward`` with it:
    the model and its head's log-probs), the backward passes and the optimizer's work
    (gradient clipping and steps). Read once per step (``read``), after the step's
    synchronisation, so timing adds no wait inside the step. On a CPU the marks are host
    clocks (the work is synchronous there)."""

    cuda: bool
    spans: list = field(default_factory=list)  # (phase, start mark, end mark)
    _open: list = field(default_factory=list)

    def _mark(self):
        return clock_mark(self.cuda)

    def start(self, phase: str) -> None:
        self._open.append((phase, self._mark()))

    def stop(self) -> None:
        phase, start = self._open.pop()
        self.spans.append((phase, start, self._mark()))

    def wrap(self, phase: str, fn):
        def timed(*args, **kwargs):
            self.start(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.stop()

        return timed

    def attach(self, model, optimizer) -> None:
        """Marks around every forward of ``model`` and every step of ``optimizer``."""
        model.register_forward_pre_hook(
            lambda *_: self.start("forward" if torch.is_grad_enabled() else "prox")
        )
        model.register_forward_hook(lambda *_: self.stop())
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's wrapper
        inner.register_step_pre_hook(lambda *_: self.start("optimizer"))
        inner.register_step_post_hook(lambda *_: self.stop())

    def read(self) -> dict[str, float]:
        """Seconds per phase since the last read (the device must be synchronised)."""
        out = dict.fromkeys(PHASES, 0.0)
        for phase, start, end in self.spans:
            out[phase] += seconds_between(start, end)
        self.spans.clear()
        return out


@dataclass
class GcTimer:
    """Seconds the garbage collector ran, and how many of its passes were of the oldest
    generation (the ones that walk every object), while ``running``."""

    seconds: float = 0.0
    full: int = 0
    running: bool = False
    _t: float = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if not self.running:
            return
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.full += info.get("generation") == 2

    def take(self) -> tuple[float, int]:
        out = (self.seconds, self.full)
        self.seconds, self.full = 0.0, 0
        return out

    def install(self) -> None:
        gc.callbacks.append(self)


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_step(step, dev: torch.device) -> dict:
    """One more step under torch.profiler: prints the operators by device time, then by
    host time, and returns the step's kernel launches, its wall (host) seconds and the
    seconds the device spent in kernels. Host time near wall time with device time well
    under it: the step is launch-bound."""
    from torch.profiler import ProfilerActivity, profile

    cuda = dev.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(dev)
        wall = time.perf_counter() - t0
    averages = prof.key_averages()
    table = averages.table
    if cuda:
        print(table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=50))
    print(table(sort_by="cpu_time_total", row_limit=10, max_name_column_width=50))
    launches = sum(e.count for e in averages if e.key in LAUNCHES)
    kernels = [e for e in averages if e.device_type == torch.autograd.DeviceType.CUDA]
    device_us = sum(e.self_device_time_total for e in kernels)  # kernels only, summed
    return {"launches": launches, "host_s": wall, "device_s": device_us / 1e6 if cuda else None}
