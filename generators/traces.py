"""What an agent's calls to the chat-completions endpoint sampled, token for token.

The endpoint (generators/endpoint.py) records every call of an episode as a ``Call``: the
prompt ids the chat template rendered and the ids the engine sampled, with their log-probs
and versions exactly as the engine returned them (never decoded and re-encoded). The
agent only ever sees text, so the trace is the one place where the tokens are known.

``EpisodeTrace.samples`` merges the calls into training samples. An agent that appends to
its conversation sends, each time, the whole history again; the template renders it, and
the new prompt begins with everything of the previous call (its prompt and its sampled
ids), followed by what came in between: the template's end-of-turn marker when the reply
was cut by the token budget (a reply that ended with end-of-turn holds it already), the
tool results or the next user message, and the next generation prompt. So a call extends
a sample when its prompt begins with that sample's ids so far; the in-between tokens are
appended with loss mask 0, log-prob 0.0 and the version of the sample's last sampled token
(the weights that made them, for the purpose of staleness, are the ones before them).

A call whose prompt does not begin with any sample's ids starts a sample of its own and is
counted in ``prefix_breaks``: the agent rewrote its history (dropped, summarised or edited
earlier messages), the template renders earlier turns differently once they are history
(some drop earlier reasoning), or the reply's text does not tokenize back to the sampled
ids (a stop string cut from it, special tokens skipped in decoding, a tool call rendered by
the template from its parsed form). Samples are never re-tokenized to force a match.

Calls of one episode may overlap (an agent with parallel branches): they are recorded in
the order they complete, and each extends the longest sample whose ids its prompt begins
with, so two branches from one point become two samples (one break), each token-exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Call:
    """One served chat-completions call."""

    prompt_ids: list[int]  # the rendered prompt, as the engine received it
    token_ids: list[int]  # sampled, as the engine returned them
    logprobs: list[float]  # of each sampled token, under the distribution it was drawn from
    versions: list[int]  # the weights version that sampled each token
    finish_reason: str  # "stop" | "length" | "tool_calls", as answered
    messages: list[dict]  # the request's messages as rendered (normalised)
    tools: list[dict] | None  # the request's tools, as given to the template
    reply: dict  # the assistant message answered (content, tool_calls)


@dataclass
class TraceStats:
    """Counts of one episode's calls."""

    calls: int = 0  # calls served and recorded
    prompt_tokens: int = 0  # summed over recorded calls
    completion_tokens: int = 0  # sampled tokens, summed over recorded calls
    errors: int = 0  # requests refused (4xx) or failed (5xx) under this episode's key
    tool_call_errors: int = 0  # what the tool-call parser reported it could not parse


@dataclass
class TraceSample:
    """A token-exact training sample: ``prompt_ids`` then ``token_ids``, where the tokens
    with ``loss_mask`` 1 were sampled and those with 0 were rendered between calls."""

    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0.0 where loss_mask is 0
    versions: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)

    @property
    def ids(self) -> list[int]:
        """The whole sequence so far."""
        return self.prompt_ids + self.token_ids


class EpisodeTrace:
    """Every call of one episode, in the order they completed, and their counts."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.stats = TraceStats()
        self.admitted = 0  # calls let through to the engine (``max_calls`` counts these)
        self.closed = False  # a call completing after this is answered 404, not recorded
        self.sampling = None  # this episode's Sampling (None: the server's)
        self.max_calls: int | None = None  # this episode's call limit (None: the server's)

    def record(self, call: Call) -> None:
        self.calls.append(call)
        self.stats.calls += 1
        self.stats.prompt_tokens += len(call.prompt_ids)
        self.stats.completion_tokens += len(call.token_ids)

    def samples(self) -> list[TraceSample]:
        """The calls merged into samples (see the module docstring)."""
        out: list[TraceSample] = []
        for call in self.calls:
            target = _longest_prefix_of(out, call.prompt_ids)
            if target is None:
                target = TraceSample(list(call.prompt_ids))
                out.append(target)
            else:
                _append_between(target, call.prompt_ids, call.versions)
            target.token_ids += call.token_ids
            target.logprobs += call.logprobs
            target.versions += call.versions
            target.loss_mask += [1] * len(call.token_ids)
        return out

    @property
    def prefix_breaks(self) -> int:
        """Calls that could not extend an earlier sample and started one of their own."""
        return max(len(self.samples()) - 1, 0)


def _longest_prefix_of(samples: list[TraceSample], prompt: list[int]) -> TraceSample | None:
    """The sample with the most ids that ``prompt`` begins with (None: none does)."""
    best, best_len = None, -1
    for s in samples:
        n = len(s.prompt_ids) + len(s.token_ids)
        if n > best_len and n <= len(prompt) and prompt[:n] == s.ids:
            best, best_len = s, n
    return best


def _append_between(sample: TraceSample, prompt: list[int], next_versions: list[int]) -> None:
    """The tokens ``prompt`` holds after ``sample``'s ids: masked out, log-prob 0.0, the
    version of the last sampled token (or, if none was sampled yet, of the next one)."""
    between = prompt[len(sample.prompt_ids) + len(sample.token_ids) :]
    version = sample.versions[-1] if sample.versions else (next_versions or [0])[0]
    sample.token_ids += between
    sample.logprobs += [0.0] * len(between)
    sample.versions += [version] * len(between)
    sample.loss_mask += [0] * len(between)
