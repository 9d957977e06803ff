"""Token ids of a multi-turn episode, exactly as the engine sees them.

An episode's ids are built by appending, never by rendering the whole conversation again:

    prompt ids  (the buffer's, or the environment's initial prompt rendered here)
    + turn 1    the ids the engine sampled, as they came (never decoded and re-encoded)
    + obs 1     the observation's *delta*: only the tokens the chat template adds for the
                observation messages after an assistant turn, up to the next generation prompt
    + turn 2 ...

``continuation`` makes the next prompt from the ids so far and an observation's delta; it
is the one place that adds the template's end-of-turn token after a turn a budget cut.

The delta is cut from a render of a fixed conversation (``_ANCHOR``: a system message, a
user message, an assistant message) followed by the observation messages: everything after
the anchor's last end-of-turn token. So the delta keeps the separator the template puts
after end-of-turn (SmolLM2's and Qwen's "\\n"), and never holds the default system prompt
that some templates (SmolLM2's among them) inject into a conversation without one: the
anchor has its own system message.

At the end of an episode ``Renderer.matches_full_render`` renders the whole conversation at
once (assistant turns as their decoded text) and compares: a template that rewrites earlier
turns, or a sampled token sequence the tokenizer would not produce from its text, shows up
as a mismatch (``multiturn/template_mismatch``); the trajectory is never rewritten.

Without a chat template (``data.chat_template: false`` or a tokenizer without one) a prompt
is a plain string and an observation is its text between newlines, tokenized as is.
"""

from __future__ import annotations

from verl_async.data import as_messages

Message = dict[str, str]

_ANCHOR: list[Message] = [
    {"role": "system", "content": "S"},
    {"role": "user", "content": "U"},
    {"role": "assistant", "content": "A"},
]


class TemplateError(ValueError):
    """A chat template this module cannot render deltas with."""


class Renderer:
    """Prompt and observation token ids for one tokenizer (one per generator)."""

    def __init__(
        self,
        tokenizer,
        chat_template: bool,
        eos_ids: set[int],
        tools: list[dict] | None = None,
        template: str | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # An episode with tools renders every prompt and observation with their schemas
        # (the template's ``tools`` argument), and with ``template`` when one is given in
        # place of the tokenizer's own (multiturn.tool_template).
        self.tools = tools or None
        self.template = template
        self.templated = bool(
            chat_template and (template or getattr(tokenizer, "chat_template", None))
        )
        self.eos_ids = set(eos_ids)
        self.separator: list[int] = []  # what the template puts after an assistant turn's end
        # The token that ends an assistant turn (the template's; plain: the tokenizer's EOS).
        eos = getattr(tokenizer, "eos_token_id", None)
        self.end_of_turn = eos if eos in self.eos_ids else min(self.eos_ids)
        if self.templated:
            anchor = self._render(_ANCHOR, generation_prompt=False)
            ends = [i for i, t in enumerate(anchor) if t in self.eos_ids]
            if not ends:
                raise TemplateError(
                    "the chat template does not end an assistant turn with an end-of-sequence "
                    "token; multi-turn episodes need one to know where a turn ends"
                )
            self._anchor_len = ends[-1] + 1
            self._anchor = anchor
            self.separator = anchor[self._anchor_len :]
            self.end_of_turn = anchor[ends[-1]]

    def with_tools(self, tools: list[dict], template: str | None = None) -> Renderer:
        """This renderer's tokenizer, rendering with ``tools`` (and ``template``)."""
        return Renderer(self.tokenizer, True, self.eos_ids, tools, template)

    def _render(self, messages: list[Message], generation_prompt: bool) -> list[int]:
        extra = {"tools": self.tools} if self.tools else {}
        if self.template:
            extra["chat_template"] = self.template
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=True, **extra
        )
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prompt_ids(self, prompt: str | list[Message]) -> list[int]:
        """The ids of an initial prompt, rendered as the buffer renders dataset prompts
        (verl_async/data.py: render_prompts)."""
        if self.templated:
            return self._render(as_messages(prompt), generation_prompt=True)
        if not isinstance(prompt, str):
            raise TemplateError(
                "the environment's initial prompt is chat messages, which need a tokenizer "
                "with a chat template and data.chat_template=true"
            )
        return list(self.tokenizer(prompt)["input_ids"])

    def observation_ids(self, messages: list[Message]) -> list[int]:
        """The tokens that follow an assistant turn's end-of-turn token: the separator, the
        observation messages and the next generation prompt (see the module docstring)."""
        if not self.templated:
            text = "\n" + "\n".join(m["content"] for m in messages) + "\n"
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])
        full = self._render([*_ANCHOR, *messages], generation_prompt=True)
        if full[: self._anchor_len] != self._anchor[: self._anchor_len]:
            raise TemplateError(
                "the chat template renders a conversation differently once messages follow "
                "it, so an observation's tokens cannot be cut from it"
            )
        return full[self._anchor_len :]

    def continuation(self, ids: list[int], delta: list[int]) -> list[int]:
        """The prompt that goes on from ``ids`` (a prompt and the turn sampled after it)
        with an observation's ``delta`` (``observation_ids``): first the template's
        end-of-turn token when the turn did not end with one (a token budget or a stop
        string cut it; a full render writes it there), then the delta. The one place
        that adds an end-of-turn token, for environments and the chat endpoint alike."""
        ended = bool(ids) and ids[-1] in self.eos_ids
        return [*ids, *([] if ended else [self.end_of_turn]), *delta]

    def full_ids(self, prompt: str | list[Message], turns: list[str], observations: list) -> list:
        """The whole conversation rendered at once: ``turns[i]`` is assistant turn i's text,
        ``observations[i]`` the messages after it (one list fewer than turns, or as many)."""
        if not self.templated:
            ids = self.prompt_ids(prompt)
            for i, text in enumerate(turns):
                ids += self.tokenizer(text, add_special_tokens=False)["input_ids"]
                ids += [self.end_of_turn]
                if i < len(observations):
                    ids += self.observation_ids(observations[i])
            return ids
        messages = as_messages(prompt)
        for i, text in enumerate(turns):
            messages.append({"role": "assistant", "content": text})
            if i < len(observations):
                messages.extend(observations[i])
        return self._render(messages, generation_prompt=len(observations) >= len(turns))

    def matches_full_render(self, incremental: list[int], full: list[int], ended: bool) -> bool:
        """Whether the incremental ids are the full render's: equal up to the separator the
        template adds after the last turn when it ended with end-of-turn, and a prefix of it
        when the turn was cut by a token budget (the template would end it)."""
        if ended:
            return full == incremental + self.separator
        return full[: len(incremental)] == incremental
