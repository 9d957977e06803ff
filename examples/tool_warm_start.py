"""A short supervised warm start that shows a small model the tool-call format, before RL.

    python examples/tool_warm_start.py [--model models/smollm2-135m]
        [--data configs/data/arith_2d_train.parquet] [--demos 8] [--epochs 1]
        [--lr 1e-5] [--out models/smollm2-135m-tools]

SmolLM2-135M-Instruct was not trained on tool calls: given the calculator's schema in the
shipped ``chatml_tools`` template it answers in prose or writes code: in 18 samples
(three prompts, six samples each, temperature 1) not one holds a ``<tool_call>`` block. RL
cannot reinforce what the policy never samples, so this script fine-tunes it on a few
demonstrations first: for the LAST ``--demos`` prompts of the data file, the conversation

    user       What is 9 + 18? Answer with just the number.
    assistant  <tool_call> {"name": "calculator", "arguments": {"expression": "9 + 18"}} </tool_call>
    tool       27
    assistant  27

rendered by the same template and tools the RL run uses (configs/tools_smollm2_cpu.yaml),
with the loss on the assistant's tokens only. Eight demonstrations, one pass at lr 1e-5,
teach the format without solving the task (48 demonstrations make every sample a right
call, leaving RL nothing to do): how often the warm model calls the tool, and copies its
answer, is what RL then raises (BENCHMARKS.md). The model is written to ``--out`` with
its tokenizer.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pyarrow.parquet as pq
import torch

from verl_async.envs.tools import calculator
from verl_async.tools.chat_templates import chat_template
from verl_async.tools.schemas import derive_schema

TOOL = "verl_async.envs.tools:calculator"


def conversation(row: dict) -> list[dict]:
    """The demonstration for one data row: a call, the tool's answer, the bare number."""
    extra = row["extra_info"]
    expression = f"{extra['a']} {extra['op']} {extra['b']}"
    call = {"type": "function", "function": {"name": "calculator",
                                             "arguments": {"expression": expression}}}  # fmt: skip
    return [
        *row["prompt"],
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": calculator(expression)},
        {"role": "assistant", "content": row["reward_model"]["ground_truth"]},
    ]


def tokenize(tokenizer, template: str, tools: list[dict], messages: list[dict]):
    """(token ids, 0/1 loss mask) of a whole conversation; the mask keeps the tokens of the
    assistant's messages. The conversation is rendered up to each message: ChatML's turn
    markers are special tokens, so the pieces' ids concatenate to the whole's."""

    def render(upto: int, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages[:upto], tools=tools, chat_template=template, tokenize=False,
            add_generation_prompt=generation_prompt,
        )  # fmt: skip

    ids: list[int] = []
    mask: list[int] = []
    done = ""
    for k, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = render(k, generation_prompt=True)
        through = render(k + 1, generation_prompt=False)
        for text, keep in ((before[len(done) :], 0), (through[len(before) :], 1)):
            piece = tokenizer(text, add_special_tokens=False)["input_ids"]
            ids += piece
            mask += [keep] * len(piece)
        done = through
    return ids, mask


def train(model, examples: list[tuple[list[int], list[int]]], epochs: int, lr: float) -> None:
    """Plain AdamW over single examples, cross-entropy on the masked-in tokens."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    model.train()
    for epoch in range(epochs):
        order = list(range(len(examples)))
        random.Random(epoch).shuffle(order)
        total = 0.0
        for i in order:
            ids, mask = examples[i]
            input_ids = torch.tensor([ids])
            labels = torch.tensor([[t if m else -100 for t, m in zip(ids, mask, strict=True)]])
            loss = model(input_ids=input_ids, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            total += float(loss.detach())
        print(f"epoch {epoch}: mean loss {total / len(examples):.4f}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/smollm2-135m"))
    ap.add_argument("--data", type=Path, default=Path("configs/data/arith_2d_train.parquet"))
    ap.add_argument("--demos", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--out", type=Path, default=Path("models/smollm2-135m-tools"))
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    template = chat_template("chatml_tools")
    tools = [derive_schema(calculator, TOOL)]
    rows = pq.read_table(args.data).to_pylist()[-args.demos :]
    examples = [tokenize(tokenizer, template, tools, conversation(r)) for r in rows]
    print(f"{len(examples)} demonstrations, {sum(sum(m) for _, m in examples)} trained tokens")
    train(model, examples, args.epochs, args.lr)
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
