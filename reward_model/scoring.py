"""Scoring with an ``AutoModelForSequenceClassification``: render, encode, pad, pool.

A conversation's score is the model's single logit at its last real token (right padding,
``config.pad_token_id`` set, so a row's score does not depend on its batch mates).

Shared prompts. A generator sends one request per prompt group: N conversations that
differ only in the assistant's response. Forwarding them whole computes the prompt N
times, and on a real task the prompt (system message and template included) is often
longer than the response. With ``share_prefix`` the longest token prefix common to a
request's conversations is forwarded once; its key/value cache is repeated over the rows
and only the differing suffixes are forwarded, attending to it. Causal attention makes the
hidden state at every suffix position the same as in the whole-row forward, so the score is
the same up to float rounding (a unit test holds them to 1e-5) while the compute falls from
N * (P + R) to P + N * R tokens. Models whose head is not a linear ``score`` layer over the
backbone's hidden states (the layout of the Llama, Qwen2, Mistral and Gemma classifiers), and
requests whose shared prefix is shorter than ``MIN_SHARED_PREFIX`` or that were truncated, go
through the whole-row path.
"""

from __future__ import annotations

from typing import Any

MIN_SHARED_PREFIX = 8  # tokens; below this the extra forward costs more than it saves


def load_reward_model(path: str, device: str, dtype: str = "float32") -> tuple[Any, Any]:
    """(model in eval mode on ``device``, tokenizer), both ready for ``score_conversations``."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=getattr(torch, dtype)
    )
    prepare(model, tokenizer)
    return model.to(device).eval(), tokenizer


def prepare(model: Any, tokenizer: Any) -> None:
    """Make padding, truncation and pooling agree between tokenizer and model."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError("the reward model's tokenizer has neither a pad nor an eos token")
        tokenizer.pad_token = tokenizer.eos_token
    # The head pools the rightmost token that is not ``config.pad_token_id``; with it unset
    # (or different from what the tokenizer pads with) padded rows would be scored at a pad.
    model.config.pad_token_id = tokenizer.pad_token_id
    model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
    # Right padding: a row keeps the positions it has alone (with absolute position
    # embeddings a left-padded row would be shifted; RoPE models do not care).
    tokenizer.padding_side = "right"
    # Keep the end of the conversation (the response being judged) when it is too long.
    tokenizer.truncation_side = "left"


def render(tokenizer: Any, conversation: list[dict[str, str]]) -> str:
    """The conversation as text: the tokenizer's chat template, else "role: content" lines."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template(conversation, tokenize=False)
    return "\n".join(f"{m['role']}: {m['content']}" for m in conversation)


def encode(tokenizer: Any, conversations: list[list[dict[str, str]]], max_length: int) -> list:
    """Token ids of each conversation, truncated from the left to ``max_length``."""
    if not conversations:
        return []
    texts = [render(tokenizer, conv) for conv in conversations]
    # A chat template writes its own special tokens (BOS included); plain text needs them.
    special = not tokenizer.chat_template
    enc = tokenizer(texts, truncation=True, max_length=max_length, add_special_tokens=special)
    return list(enc["input_ids"])


def forward(model: Any, tokenizer: Any, rows: list[list[int]]) -> list[float]:
    """Scores of one padded batch: logits[:, 0], pooled by the model at the last real token."""
    import torch

    padded = tokenizer.pad({"input_ids": rows}, padding=True, return_tensors="pt")
    device = next(model.parameters()).device
    with torch.inference_mode():
        logits = model(
            input_ids=padded["input_ids"].to(device),
            attention_mask=padded["attention_mask"].to(device),
        ).logits
    return logits[:, 0].float().cpu().tolist()


def score_conversations(
    model: Any,
    tokenizer: Any,
    conversations: list[list[dict[str, str]]],
    batch_size: int,
    max_length: int,
) -> list[float]:
    """One score per conversation, in order, every row forwarded whole (no prefix sharing)."""
    return score_requests(model, tokenizer, [conversations], batch_size, max_length, False)[0]


def score_requests(
    model: Any,
    tokenizer: Any,
    requests: list[list[list[dict[str, str]]]],
    batch_size: int,
    max_length: int,
    share_prefix: bool = True,
) -> list[list[float]]:
    """Scores of each request's conversations, in order; forwards of at most ``batch_size``.

    A request whose rows share a prefix (see the module docstring) is scored on its own;
    the other rows of all requests are pooled, sorted by length so a batch pads little, and
    chunked.
    """
    rows = [encode(tokenizer, convs, max_length) for convs in requests]
    scores = [[0.0] * len(r) for r in rows]
    whole: list[tuple[int, int]] = []  # (request, row) scored in the pooled path
    shareable = share_prefix and prefix_head(model) is not None
    for k, request_rows in enumerate(rows):
        shared = shared_prefix_length(request_rows, max_length) if shareable else 0
        if shared:
            for start in range(0, len(request_rows), batch_size):
                chunk = request_rows[start : start + batch_size]
                scores[k][start : start + len(chunk)] = forward_shared(model, chunk, shared)
        else:
            whole.extend((k, i) for i in range(len(request_rows)))
    whole.sort(key=lambda ki: len(rows[ki[0]][ki[1]]))
    for start in range(0, len(whole), batch_size):
        chunk = whole[start : start + batch_size]
        values = forward(model, tokenizer, [rows[k][i] for k, i in chunk])
        for (k, i), value in zip(chunk, values, strict=True):
            scores[k][i] = value
    return scores


def prefix_head(model: Any) -> Any:
    """The linear ``score`` head if the model is backbone + per-token linear head, else None."""
    import torch

    head = getattr(model, "score", None)
    if isinstance(head, torch.nn.Linear) and model.base_model is not model:
        return head
    return None


def shared_prefix_length(rows: list[list[int]], max_length: int) -> int:
    """Tokens to forward once for ``rows`` (0: share nothing).

    At most one less than the shortest row, so every row keeps a suffix to pool at. A row
    of exactly ``max_length`` tokens may have been truncated from the left, which would make
    the common prefix an accident of where the cut fell: those requests share nothing.
    """
    if len(rows) < 2 or any(len(row) >= max_length for row in rows):
        return 0
    first = rows[0]
    length = min(len(row) for row in rows) - 1
    for row in rows[1:]:
        i = 0
        while i < length and row[i] == first[i]:
            i += 1
        length = i
    return length if length >= MIN_SHARED_PREFIX else 0


def forward_shared(model: Any, rows: list[list[int]], shared: int) -> list[float]:
    """Scores of ``rows`` whose first ``shared`` tokens are equal: the prefix is forwarded
    once, its cache repeated over the rows, the right-padded suffixes forwarded on top."""
    import torch

    device = next(model.parameters()).device
    base, head = model.base_model, prefix_head(model)
    suffixes = [row[shared:] for row in rows]
    width = max(len(s) for s in suffixes)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), shared + width, dtype=torch.long)
    mask[:, :shared] = 1
    for i, suffix in enumerate(suffixes):
        ids[i, : len(suffix)] = torch.tensor(suffix)
        mask[i, shared : shared + len(suffix)] = 1
    positions = torch.arange(shared, shared + width).expand(len(rows), -1)
    last = torch.tensor([len(s) - 1 for s in suffixes])
    with torch.inference_mode():
        prefix = torch.tensor([rows[0][:shared]], device=device)
        cache = base(input_ids=prefix, use_cache=True).past_key_values
        cache.batch_repeat_interleave(len(rows))  # in place: [1, ...] -> [B, ...]
        hidden = base(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            position_ids=positions.to(device),
            past_key_values=cache,
            use_cache=True,
        ).last_hidden_state  # [B, width, H]
        pooled = hidden[torch.arange(len(rows)), last.to(device)]
        return head(pooled)[:, 0].float().cpu().tolist()
