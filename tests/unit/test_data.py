"""Prompt files in verl's and the plain layout, bad files, rendering and the length filter."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from verl_async.config import ConfigError
from verl_async.data import epoch_order, load_prompts, render_prompts


def _verl_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _verl_row(i, content="max 1 2 ="):
    return {
        "prompt": [{"role": "system", "content": "answer"}, {"role": "user", "content": content}],
        "data_source": "toy" if i % 2 else "other",
        "reward_model": {"ground_truth": str(i), "style": "rule"},
        "extra_info": {"index": i, "split": "train"},
    }


def test_verl_parquet_layout_is_read_as_it_is(tmp_path):
    recs = load_prompts(_verl_parquet(tmp_path / "d.parquet", [_verl_row(i) for i in range(3)]))
    assert [r.ground_truth for r in recs] == ["0", "1", "2"]
    assert [r.data_source for r in recs] == ["other", "toy", "other"]
    assert recs[1].prompt[1] == {"role": "user", "content": "max 1 2 ="}
    assert recs[2].extra_info == {"index": 2, "split": "train"}


def test_plain_jsonl_layout(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"p{i}", "answer": i}) + "\n" for i in range(2)))
    recs = load_prompts(path)
    assert [(r.prompt, r.ground_truth, r.data_source) for r in recs] == [
        ("p0", "0", "default"),
        ("p1", "1", "default"),
    ]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("", "is empty"),
        ('{"prompt": "x"}\n', "neither 'reward_model'"),
        ('{"answer": "1"}\n', "no 'prompt' column"),
        ('{"prompt": 3, "answer": "1"}\n', "neither a string nor"),
        ("not json\n", "line 1 of .* is not valid JSON"),
        (" \n\n", "is empty"),
    ],
)
def test_bad_files_give_one_error_naming_the_key(tmp_path, content, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message) as err:
        load_prompts(path, "data.val_path")
    assert "'data.val_path'" in str(err.value)


def test_missing_file_and_empty_parquet(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_prompts(tmp_path / "nope.parquet")
    empty = pa.Table.from_pylist([_verl_row(0)]).slice(0, 0)
    pq.write_table(empty, tmp_path / "e.parquet")
    with pytest.raises(ConfigError, match="holds no prompts"):
        load_prompts(tmp_path / "e.parquet")


def test_a_malformed_jsonl_line_is_named_by_its_line_number(tmp_path):
    # Past pyarrow's first block (1 MiB), where its own row numbers restart.
    lines = [json.dumps({"prompt": f"p{i}" * 5, "answer": str(i)}) for i in range(40_000)]
    lines[31_414] = '{"prompt": "x", "answer": '
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    assert path.stat().st_size > 2**20
    with pytest.raises(ConfigError) as err:
        load_prompts(path)
    assert str(err.value).startswith(
        f"bad value for 'data.path': line 31415 of '{path}' is not valid JSON (Expecting value"
    )


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"prompt": "a", "answer": "1"}', '{"prompt": "b", "answer": 2}'], "line 2 of"),
        (['{"prompt": "a", "answer": "1"}', "[1, 2]"], "line 2 of .* is not a JSON object"),
        (['{"prompt": "a", "answer": "1"}', "", '{"prompt": 7, "answer": "1"}'], "line 3 of"),
    ],
)
def test_jsonl_rows_pyarrow_refuses_are_named_by_line(tmp_path, lines, message):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError, match=message) as err:
        load_prompts(path)
    assert "\n" not in str(err.value)


def test_a_jsonl_line_longer_than_pyarrows_block_is_read(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "x" * (3 * 2**20), "answer": "1"}, {"prompt": "y", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert [r.ground_truth for r in load_prompts(path)] == ["1", "2"]


@pytest.mark.parametrize(
    ("rows", "message"),
    [
        ([{"question": "q", "answer": "1"}], "no 'prompt' column"),
        ([{"prompt": "q"}], "neither 'reward_model'"),
        ([{"prompt": "q", "reward_model": {"style": "rule"}}], "without 'ground_truth'"),
        ([{"prompt": 3, "answer": "1"}], "row 0 of"),
    ],
)
def test_parquet_column_errors_name_the_file_and_the_key(tmp_path, rows, message):
    path = _verl_parquet(tmp_path / "d.parquet", rows)
    with pytest.raises(ConfigError, match=message) as err:
        load_prompts(path, "data.val_path")
    assert str(err.value).startswith("bad value for 'data.val_path'") and str(path) in str(
        err.value
    )


def test_a_corrupt_parquet_file_names_the_file(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1" + b"\0" * 64)
    with pytest.raises(ConfigError, match="cannot be read") as err:
        load_prompts(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


class _Tokenizer:
    """A stand-in with the two calls render_prompts makes: one token per character."""

    def __init__(self, template):
        self.chat_template = template

    def __call__(self, text):
        return {"input_ids": [ord(c) for c in text]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt and tokenize
        text = "|".join(f"{m['role']}:{m['content']}" for m in messages) + "|assistant:"
        return [ord(c) for c in text]


def test_render_uses_the_template_and_skips_long_prompts(tmp_path):
    recs = load_prompts(
        _verl_parquet(tmp_path / "d.parquet", [_verl_row(0, "short"), _verl_row(1, "x" * 50)])
    )
    kept, skipped = render_prompts(recs, _Tokenizer("tmpl"), chat_template=True, max_length=40)
    assert skipped == 1 and len(kept) == 1
    assert "".join(map(chr, kept[0].prompt_ids)) == "system:answer|user:short|assistant:"


def test_strings_go_raw_without_a_template_and_messages_need_one(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"prompt": "ab", "answer": "1"}) + "\n")
    kept, _ = render_prompts(load_prompts(path), _Tokenizer(None), chat_template=True, max_length=9)
    assert kept[0].prompt_ids == (97, 98)
    kept, _ = render_prompts(load_prompts(path), _Tokenizer("t"), chat_template=False, max_length=9)
    assert kept[0].prompt_ids == (97, 98)
    messages = load_prompts(_verl_parquet(tmp_path / "m.parquet", [_verl_row(0)]))
    with pytest.raises(ConfigError, match="data.chat_template"):
        render_prompts(messages, _Tokenizer(None), chat_template=True, max_length=99)


def test_each_epoch_is_a_new_seeded_permutation():
    a, b = epoch_order(50, 0, seed=3), epoch_order(50, 1, seed=3)
    assert sorted(a) == sorted(b) == list(range(50)) and a != b
    assert a == epoch_order(50, 0, seed=3) and a != epoch_order(50, 0, seed=4)


def test_gsm8k_rows_are_in_verl_layout_and_load(tmp_path):
    from verl_async.tasks.gsm8k import to_rows

    rows = to_rows(
        [
            {
                "question": "Tom has 1,200 apples and buys 34. How many?",
                "answer": "1200+34\n#### 1,234",
            }
        ],
        "train",
    )
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "g.parquet")
    (rec,) = load_prompts(tmp_path / "g.parquet")
    assert rec.ground_truth == "1234" and rec.data_source == "openai/gsm8k"
    assert rec.prompt[0]["role"] == "user" and "####" in rec.prompt[0]["content"]
    assert rec.extra_info["solution"].endswith("#### 1,234")


def test_max_digit_files_are_what_the_generator_writes(tmp_path):
    """The shipped train and held-out files regenerate byte for byte, and no held-out
    prompt is a training prompt."""
    from pathlib import Path

    from verl_async.tasks.max_digit import write_files

    root = Path(__file__).resolve().parents[2] / "configs/data"
    for made in write_files(tmp_path):
        assert made.read_bytes() == (root / made.name).read_bytes(), made.name
    seen = {json.loads(line)["prompt"] for line in (root / "max_digit.jsonl").open()}
    val = [json.loads(line) for line in (root / "max_digit_val.jsonl").open()]
    assert len(val) == 512 and not {r["prompt"] for r in val} & seen
    assert all(r["answer"] == max(r["prompt"].split()[1:-1]) for r in val)
