"""The one recorder every rollout goes through (generators/recorder.py), on hand-written
requests: the ids are those of a ChatML-like template whose end-of-turn is EOS = 2 and
whose generation prompt is [START, ASSISTANT]. Requests that extend a sample become one
sample; one that does not starts another; the episode's stats are made in one place."""

from generators.interface import Sample
from generators.recorder import EpisodeRecorder
from generators.trajectory import pack

EOS, START, USER, ASSISTANT, TOOL = 2, 10, 11, 12, 13
GEN = [START, ASSISTANT]
P1 = [START, USER, 5, EOS, *GEN]


def sample(tokens, versions=None) -> Sample:
    versions = versions or [0] * len(tokens)
    return Sample(list(tokens), [-0.5 - i for i in range(len(tokens))], list(versions))


def recorded(*calls, index=0) -> EpisodeRecorder:
    """Each call (prompt, tokens[, versions]) recorded in order."""
    rec = EpisodeRecorder(index)
    for prompt, tokens, *versions in calls:
        rec.record(prompt, sample(tokens, *versions), "text")
    return rec


def test_a_reply_that_ended_with_end_of_turn_holds_it_and_the_next_prompt_extends_it():
    between = [START, TOOL, 9, EOS, *GEN]  # the tool's answer and the next generation prompt
    rec = recorded((P1, [7, 8, EOS], [3, 3, 4]), (P1 + [7, 8, EOS] + between, [6, EOS], [5, 5]))
    [s] = rec.samples
    assert s.prompt_ids == P1
    assert s.token_ids == [7, 8, EOS, *between, 6, EOS]
    assert s.loss_mask == [1, 1, 1] + [0] * len(between) + [1, 1]
    assert s.logprobs == [-0.5, -1.5, -2.5] + [0.0] * len(between) + [-0.5, -1.5]
    # The in-between tokens carry the last sampled token's version.
    assert s.versions == [3, 3, 4] + [4] * len(between) + [5, 5]
    assert s.turn_ends == [3, 3 + len(between) + 2] and s.turns == ["text", "text"]


def test_a_reply_cut_by_the_budget_gets_its_end_of_turn_from_the_next_prompt_unmasked():
    between = [EOS, START, USER, 4, EOS, *GEN]  # the template closes the turn itself
    rec = recorded((P1, [7, 8, 9]), (P1 + [7, 8, 9] + between, [6]))
    [s] = rec.samples
    assert s.token_ids == [7, 8, 9, *between, 6]
    assert s.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    [t] = rec.finish(P1, [])
    assert t.stats.prefix_breaks == 0 and t.stats.observation_tokens == len(between)


def test_a_rewritten_history_starts_a_new_sample_and_counts_a_break():
    c2 = [START, USER, 4, EOS, *GEN]  # the first exchange dropped
    c3 = c2 + [8, EOS, START, USER, 3, EOS, *GEN]
    rec = recorded((P1, [7, EOS]), (c2, [8, EOS]), (c3, [9]))
    s1, s2 = rec.samples
    assert s1.ids() == P1 + [7, EOS] and s1.loss_mask == [1, 1]
    assert s2.ids() == c3 + [9] and s2.prompt_ids == c2
    first, second = rec.finish(P1, [])
    assert (first.stats.prefix_breaks, second.stats.prefix_breaks) == (1, 0)
    # A reply tokenized back differently (here: a skipped token) also breaks the prefix.
    rec.record(c3 + [EOS, *GEN], sample([5]), "")  # c3's reply 9 missing from the history
    assert len(rec.samples) == 3


def test_parallel_branches_from_one_point_are_two_samples_each_extended_by_its_own_calls():
    a_prompt = P1 + [7, EOS, START, USER, 1, EOS, *GEN]
    b_prompt = P1 + [7, EOS, START, USER, 2, EOS, *GEN]
    a_more = a_prompt + [4, EOS, START, TOOL, EOS, *GEN]
    rec = recorded((P1, [7, EOS]), (a_prompt, [4, EOS]), (b_prompt, [3, EOS]), (a_more, [6]))
    a, b = rec.samples  # completion order
    assert a.ids() == a_more + [6]
    assert b.ids() == b_prompt + [3, EOS]
    assert b.sampled() == 2  # b's prompt holds the root's reply, not sampled by it
    assert rec.finish(P1, [])[0].stats.prefix_breaks == 1


def test_an_empty_reply_and_an_episode_that_sampled_nothing():
    rec = recorded((P1, []), (P1 + [EOS, START, USER, 4, EOS, *GEN], [6], [7]))
    [s] = rec.samples
    assert s.versions == [7] * len(s.token_ids)  # the in-between takes the next version
    assert s.loss_mask[-1] == 1 and s.sampled() == 1
    # Nothing recorded at all: one sample of the given prompt with no response.
    [empty] = EpisodeRecorder(3).finish(P1, [])
    assert (empty.prompt_ids, empty.token_ids, empty.stats.turns) == (P1, [], 0)
    assert empty.stats.episode == 3


def test_counts_sit_on_the_first_sample_and_every_sample_names_its_episode():
    c2 = [START, USER, 4, EOS, *GEN]
    rec = recorded((P1, [7, EOS], [1, 1]), (c2, [8, 9], [2, 3]), index=5)
    rec.counts.tool_calls, rec.counts.tool_errors, rec.counts.env_seconds = 2, 1, 0.5
    rec.counts.budget = "episode_timeout"
    a, b = rec.finish(P1, [{"role": "user", "content": "q"}], final_text="answer")
    assert (a.stats.tool_calls, a.stats.tool_errors, a.stats.env_seconds) == (2, 1, 0.5)
    assert (b.stats.tool_calls, b.stats.tool_errors, b.stats.env_seconds) == (0, 0, 0.0)
    assert (a.stats.episode, b.stats.episode) == (5, 5)
    assert a.stats.budget == b.stats.budget == "episode_timeout"
    assert (a.stats.versions_spanned, b.stats.versions_spanned) == (0, 1)
    assert a.text == b.text == "answer" and a.messages == [{"role": "user", "content": "q"}]


def test_a_single_turn_request_is_one_sample_without_episode_stats():
    rec = recorded((P1, [7, EOS]))
    t = rec.single_turn()
    assert (t.token_ids, t.loss_mask, t.stats, t.text) == ([7, EOS], [1, 1], None, "text")


def test_an_episode_that_sampled_nothing_packs_as_an_empty_response_beside_calling_ones():
    """An agent that never called the model (or raised before it did) shares a group with
    agents that did: their prompts came from the endpoint (rendered with tools), its own
    is the buffer's. Its sample must be an empty response, never the rest of a prompt
    with loss mask 0 (which the buffer refuses: a response ends on a sampled token)."""
    rendered = [START, TOOL, 99, EOS, START, USER, 5, EOS, *GEN]  # with tool schemas
    calling = recorded((rendered, [7, EOS]), index=0).finish(P1, [])
    silent = EpisodeRecorder(1).finish(P1, [])
    packed = pack(P1, [*calling, *silent])
    assert packed.lengths[1] == 0  # the silent episode: an empty response
    mask = packed.loss_mask.tolist()
    assert mask[packed.lengths[0] - 1] == 1  # the calling one ends on a sampled token
    assert packed.prompt_ids == rendered  # the prompt of the samples that sampled
    assert [e.episode for e in packed.episodes] == [0, 1]
