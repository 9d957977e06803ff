"""Merging an episode's chat-completions calls into token-exact samples
(generators/traces.py), on hand-written calls: the ids are those of a ChatML-like template
whose end-of-turn is EOS = 2 and whose generation prompt is [START, ASSISTANT]."""

from generators.traces import Call, EpisodeTrace, TraceStats

EOS, START, USER, ASSISTANT, TOOL = 2, 10, 11, 12, 13
GEN = [START, ASSISTANT]


def call(prompt, tokens, versions=None, finish="stop"):
    versions = versions or [0] * len(tokens)
    logprobs = [-0.5 - i for i in range(len(tokens))]
    return Call(prompt, tokens, logprobs, versions, finish, [], None, {"role": "assistant"})


def trace_of(*calls) -> EpisodeTrace:
    trace = EpisodeTrace()
    for c in calls:
        trace.record(c)
    return trace


def test_a_reply_that_ended_with_end_of_turn_holds_it_and_the_next_prompt_extends_it():
    p1 = [START, USER, 5, EOS, *GEN]
    c1 = call(p1, [7, 8, EOS], versions=[3, 3, 4])
    between = [START, TOOL, 9, EOS, *GEN]  # the tool's answer and the next generation prompt
    c2 = call(p1 + [7, 8, EOS] + between, [6, EOS], versions=[5, 5])
    [s] = trace_of(c1, c2).samples()
    assert s.prompt_ids == p1
    assert s.token_ids == [7, 8, EOS, *between, 6, EOS]
    assert s.loss_mask == [1, 1, 1] + [0] * len(between) + [1, 1]
    assert s.logprobs == [-0.5, -1.5, -2.5] + [0.0] * len(between) + [-0.5, -1.5]
    # The in-between tokens carry the last sampled token's version.
    assert s.versions == [3, 3, 4] + [4] * len(between) + [5, 5]
    assert s.ids == c2.prompt_ids + c2.token_ids


def test_a_reply_cut_by_the_budget_gets_its_end_of_turn_from_the_template_unmasked():
    p1 = [START, USER, 5, EOS, *GEN]
    c1 = call(p1, [7, 8, 9], finish="length")  # no EOS sampled
    between = [EOS, START, USER, 4, EOS, *GEN]  # the template closes the turn itself
    c2 = call(p1 + [7, 8, 9] + between, [6])
    trace = trace_of(c1, c2)
    [s] = trace.samples()
    assert s.token_ids == [7, 8, 9, *between, 6]
    assert s.loss_mask == [1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1]
    assert trace.prefix_breaks == 0


def test_a_rewritten_history_starts_a_new_sample_and_counts_a_break():
    p1 = [START, USER, 5, EOS, *GEN]
    c1 = call(p1, [7, EOS])
    c2 = call([START, USER, 4, EOS, *GEN], [8, EOS])  # the first exchange dropped
    c3 = call(c2.prompt_ids + c2.token_ids + [START, USER, 3, EOS, *GEN], [9])
    trace = trace_of(c1, c2, c3)
    s1, s2 = trace.samples()
    assert s1.ids == p1 + [7, EOS] and s1.loss_mask == [1, 1]
    assert s2.ids == c3.prompt_ids + c3.token_ids and s2.prompt_ids == c2.prompt_ids
    assert trace.prefix_breaks == 1
    # A reply re-tokenized differently (here: a skipped token) also breaks the prefix.
    c4 = call(c3.prompt_ids + [EOS, *GEN], [5])  # c3's token 9 missing from the history
    assert trace_of(c1, c2, c3, c4).prefix_breaks == 2


def test_parallel_branches_from_one_point_are_two_samples_each_extended_by_its_own_calls():
    p1 = [START, USER, 5, EOS, *GEN]
    root = call(p1, [7, EOS])
    branch_a = call(p1 + [7, EOS, START, USER, 1, EOS, *GEN], [4, EOS])
    branch_b = call(p1 + [7, EOS, START, USER, 2, EOS, *GEN], [3, EOS])
    a_more = call(branch_a.prompt_ids + branch_a.token_ids + [START, TOOL, EOS, *GEN], [6])
    trace = trace_of(root, branch_a, branch_b, a_more)  # completion order
    a, b = trace.samples()
    assert a.ids == a_more.prompt_ids + a_more.token_ids
    assert b.ids == branch_b.prompt_ids + branch_b.token_ids
    assert sum(b.loss_mask) == len(branch_b.token_ids)  # b's prompt holds root's reply unmasked
    assert trace.prefix_breaks == 1


def test_an_empty_reply_and_an_empty_trace():
    assert trace_of().samples() == [] and trace_of().prefix_breaks == 0
    p1 = [START, USER, 5, EOS, *GEN]
    c1 = call(p1, [])  # nothing sampled
    c2 = call(p1 + [EOS, START, USER, 4, EOS, *GEN], [6], versions=[7])
    [s] = trace_of(c1, c2).samples()
    assert s.versions == [7] * len(s.token_ids)  # the in-between takes the next version
    assert s.loss_mask[-1] == 1 and sum(s.loss_mask) == 1


def test_stats_count_calls_and_tokens():
    trace = trace_of(call([1, 2, 3], [4, 5]), call([1, 2, 3, 4, 5, 6], [7]))
    assert trace.stats == TraceStats(calls=2, prompt_tokens=9, completion_tokens=3)
