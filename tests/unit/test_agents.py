"""An agent episode's recorded samples as trajectories (generators/agents.py), and the
endpoint's tool-call parser built on the run's named parser."""

from generators.agents import ToolCalls, _trajectory
from generators.traces import TraceSample


def test_a_recorded_sample_becomes_a_trajectory_whose_turns_are_its_sampled_runs():
    s = TraceSample([1, 2], [5, 6, 0, 0, 7, 9, 9], [-1, -1, 0, 0, -1, 0, 0], [3] * 7,
                    [1, 1, 0, 0, 1, 0, 0])  # fmt: skip
    t = _trajectory(s, "42")
    # Tokens after the last sampled one train nothing and are left out.
    assert t.token_ids == [5, 6, 0, 0, 7] and t.loss_mask == [1, 1, 0, 0, 1]
    assert t.turn_ends == [2, 5] and t.turns == ["", "42"] and t.text == "42"
    assert t.rewards == [0.0] * 5
    t.add_reward(0.5)  # the agent's reward: at the last sampled token
    assert t.rewards == [0.0, 0.0, 0.0, 0.0, 0.5]
    empty = _trajectory(TraceSample([1, 2]), "")
    assert (empty.token_ids, empty.turns, empty.text) == ([], [], "")


def test_the_endpoint_s_parser_reads_calls_in_the_run_s_format():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"x": 0}, "x")))
    tools = [{"type": "function", "function": {"name": "add", "description": "Add.",
              "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]  # fmt: skip
    parse = ToolCalls("hermes", tok)
    content, calls, errors = parse(
        'Sure. <tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>', tools
    )
    assert (content, errors) == ("Sure. ", []) and calls == [
        {"name": "add", "arguments": '{"a": 1}'}
    ]
    content, calls, errors = parse('<tool_call>{"name": "add", </tool_call>', tools)
    assert calls == [] and errors and "invalid JSON" in errors[0]
    assert len(parse._parsers) == 1  # one vLLM parser per tool set, kept
