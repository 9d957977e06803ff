"""The one token-exact recorder behind every rollout: each engine request of an episode,
the ids it continued and the ids it sampled, made into trajectories.

Every kind of rollout (generators/rollouts.py) records the same way: ``record(prompt_ids,
sample, text)`` for each request it makes. A request whose prompt begins with the ids of
a sample recorded so far extends that sample (the longest such): the tokens in between
are appended as not sampled (loss mask 0: the template's end-of-turn after a cut turn, an
observation or tool results, the next generation prompt), then the sampled ones. Any
other request starts a sample of its own::

    single-turn   one request                                        one sample
    environment   each turn continues the last: its prompt is        one sample
                  Renderer.continuation(ids so far, observation delta)
    agent         a call that continues an earlier call is given     one sample, or one
                  that call's ids + continuation (generators/        more per call that
                  endpoint.py); a call that rewrote the history      rewrote the history
                  is rendered whole                                  (``prefix_breaks``)

So the ids between turns are whatever the next prompt holds: never decoded and encoded
again, never guessed. Calls of one episode may overlap (an agent with parallel
branches): each is recorded when it completes and extends the longest sample its prompt
begins with, so two branches from one point become two samples, each token-exact.

``EpisodeCounts`` is what every kind counts of an episode, and ``finish`` the one place an
episode's ``EpisodeStats`` are made: the episode's counts sit on its first sample (so
sums over samples are the episode's), each sample's own turns, observation tokens and
versions on it; every sample names its episode (``EpisodeStats.episode``), so the buffer
and the learner count a group in episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

from generators.interface import Sample
from generators.trajectory import Message, Trajectory
from verl_async import protocol as P


@dataclass
class EpisodeCounts:
    """What happened in one episode besides its tokens, whatever kind it is."""

    tool_calls: int = 0  # tool calls run (or environment steps that ran a tool)
    tool_errors: int = 0  # calls that failed: raised, refused, cut, unknown tool, bad request
    tool_timeouts: int = 0  # calls past their deadline
    tool_parse_errors: int = 0  # malformed tool calls in the model's turns
    env_seconds: float = 0.0  # wall time in the environment's (or the agent's) code
    env_reward: float = 0.0  # the environment's (or agent's) rewards, summed
    weighted_reward: float = 0.0  # the same times env_reward_weight: what the learner sums
    budget: str = ""  # the budget that ended the episode ("" : none did)

    def fault(self, timed_out: bool) -> None:
        """One failed call: a timeout or an error."""
        if timed_out:
            self.tool_timeouts += 1
        else:
            self.tool_errors += 1


class EpisodeRecorder:
    """One episode's samples, token for token, and its counts."""

    def __init__(self, index: int, counts: EpisodeCounts | None = None) -> None:
        self.index = index  # the episode's place in its group
        self.samples: list[Trajectory] = []
        self.counts = EpisodeCounts() if counts is None else counts

    def record(self, prompt_ids: list[int], sample: Sample, text: str) -> Trajectory:
        """A request that continued ``prompt_ids`` and sampled ``sample`` (``text`` its
        decoded text); returns the sample it went into."""
        target = self._extends(prompt_ids)
        if target is None:
            target = Trajectory(list(prompt_ids))
            self.samples.append(target)
        else:
            target.add_between(prompt_ids[target.length() :], (sample.versions or [0])[0])
        return target.add_turn(sample, text)

    def _extends(self, prompt_ids: list[int]) -> Trajectory | None:
        """The sample with the most ids that ``prompt_ids`` begins with (None: none)."""
        best, best_len = None, -1
        for t in self.samples:
            n = t.length()
            if best_len < n <= len(prompt_ids) and prompt_ids[:n] == t.ids():
                best, best_len = t, n
        return best

    @property
    def last(self) -> Trajectory | None:
        return self.samples[-1] if self.samples else None

    def finish(
        self,
        prompt_ids: list[int],
        conversation: list[Message],
        template_mismatch: bool = False,
        final_text: str | None = None,
    ) -> list[Trajectory]:
        """The episode's trajectories with their stats and ``conversation``. An episode
        that sampled nothing is one sample of ``prompt_ids`` with an empty response.
        ``final_text``: what the reward sources score, in place of each sample's last
        turn's text (an agent's final answer: every sample is scored as the episode)."""
        if not self.samples:
            self.samples.append(Trajectory(list(prompt_ids)))
        c = self.counts
        out = []
        for i, t in enumerate(self.samples):
            first = i == 0
            sampled = t.sampled_versions()
            stats = P.EpisodeStats(
                turns=len(t.turns),
                tool_calls=c.tool_calls if first else 0,
                tool_errors=c.tool_errors if first else 0,
                tool_timeouts=c.tool_timeouts if first else 0,
                env_seconds=c.env_seconds if first else 0.0,
                observation_tokens=t.loss_mask.count(0),
                budget=c.budget,
                versions_spanned=max(sampled) - min(sampled) if sampled else 0,
                template_mismatch=template_mismatch,
                env_reward=c.env_reward if first else 0.0,
                tool_parse_errors=c.tool_parse_errors if first else 0,
                prefix_breaks=len(self.samples) - 1 if first else 0,
                episode=self.index,
            )
            out.append(t.finish(stats, conversation, final_text))
        return out

    def single_turn(self) -> Trajectory:
        """The one sample of a single-turn request, as it is (no episode stats: every
        token sampled, nothing to say on the wire)."""
        [sample] = self.samples
        return sample
