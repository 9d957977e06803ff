"""The run configuration's schema: one typed section per part of the system, and
``RunConfig`` holding them all.

Every field has a type, bounds where they matter, and a docstring right under it (the
config reference, docs/config.md, is generated from them). Loading a YAML file, applying
``dotted.key=value`` overrides and the rules that span several sections live in
``config.py``. No torch, no vLLM: ``verl-async --help`` stays instant.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from verl_async.algos.correction.settings import PRESETS, RolloutCorrection, resolve
from verl_async.config_base import (
    ConfigError,
    Fraction,
    NonNegFloat,
    NonNegInt,
    Port,
    PosFloat,
    PosInt,
    _Section,
)
from verl_async.reward_config import RewardsConfig


class TinyModelConfig(_Section):
    hidden_size: PosInt = 128
    """Width of the tiny model built when ``model.path`` is empty."""
    num_layers: PosInt = 2
    """Decoder layers of the tiny model."""
    num_heads: PosInt = 4
    """Attention heads; hidden_size / num_heads must be >= 32 (vLLM CPU kernels)."""
    num_kv_heads: PosInt = 2
    """Key/value heads (grouped-query attention)."""
    intermediate_size: PosInt = 256
    """MLP width of the tiny model."""
    seed: int = 0
    """Seed of the random initialisation (same seed -> same weights)."""
    extra_words: list[str] = []
    """Words appended to the tiny vocabulary, e.g. the feedback words of a multi-turn
    environment ("wrong", "higher"); the default vocabulary is unchanged, so runs without
    extra words build the same model."""


class LoraConfig(_Section):
    rank: NonNegInt = 0
    """LoRA rank r; 0 trains every weight (full fine-tuning). With generators.engine=vllm it
    must be a rank vLLM serves (1, 8, 16, 32, 64, 128, 256, 320 or 512 in vLLM 0.32)."""
    alpha: PosFloat = 16.0
    """Scale of the adapter's update: alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0: the learner's log-probs equal the
    generators')."""
    target_modules: list[str] = msgspec.field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"]
    )
    """Names of the linear layers that get an adapter (peft's ``target_modules``), or
    ["all-linear"]."""


class ModelConfig(_Section):
    path: str = ""
    """Hugging Face model directory. Empty: build the tiny model into ``<run_dir>/model``."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Weights dtype in generators and learner (float32 on CPUs without AVX-512)."""
    tiny: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
    """Shape of the locally built tiny model."""
    lora: LoraConfig = msgspec.field(default_factory=LoraConfig)
    """Train LoRA adapters on a frozen base (``rank`` > 0): the learner trains and sends
    only the adapter, generators load each version as an adapter (docs/lora.md)."""


class DataConfig(_Section):
    path: str = "configs/data/max_digit.jsonl"
    """Training prompts, JSONL or Parquet, relative to the working directory. Either verl's
    layout (``prompt``: list of chat messages, ``data_source``, ``reward_model.ground_truth``,
    ``extra_info``) or the plain one (``prompt``: string, ``answer``). See docs/data.md."""
    val_path: str = ""
    """Validation prompts in the same layouts, scored by ``eval`` (empty: no evaluation)."""
    shuffle_seed: int = 0
    """Seed of the per-epoch prompt order (every epoch is a new permutation)."""
    chat_template: bool = True
    """Render prompts with the tokenizer's chat template (a plain string prompt becomes one
    user message). False, or a tokenizer without a template: string prompts go in as they are."""
    max_prompt_length: NonNegInt = 0
    """Prompts longer than this many tokens (after the template) are skipped and counted in
    the buffer's log and ``prompts_skipped``; 0 means generators.max_model_len - max_new_tokens,
    or with environments multiturn.max_episode_tokens - max_new_tokens if that is less (an
    episode's prompt leaves room for its first turn)."""


class BufferConfig(_Section):
    host: str = "127.0.0.1"
    """Address the buffer, the reward models and (unless ``weights.host`` is set) the
    weight-sync store bind: loopback by default; anything else requires ``keys_dir``."""
    port: Port = 0
    """Buffer port; 0 picks a free one."""
    request_timeout_s: PosFloat = 60.0
    """A client gives up on the buffer (and says so) after this long without a reply."""
    lease_timeout_s: PosFloat = 300.0
    """A prompt group neither returned nor renewed for this long goes to the next generator
    that asks, and its holder's late rollout is dropped (work lost, logged). The holder
    renews every group it works on every third of this, so it bounds how long a dead or
    stalled generator keeps its groups, not how long a group may take; keep it well below
    ``weights.join_timeout_s``, the learner's wait for one step."""
    lease_max_s: PosFloat = 1800.0
    """No renewal keeps a group longer than this after its issue: a generator that goes on
    renewing but never finishes (an engine stuck while its event loop runs) loses it then.
    Longer than the slowest group takes to sample and score (for agent episodes
    ``multiturn.episode_timeout_s`` plus scoring and weight swaps). A lease always lasts
    ``lease_timeout_s`` from its issue: below that, renewals change nothing."""
    keys_dir: str = ""
    """CurveZMQ key set made by ``verl-async keys DIR`` (relative to the working directory):
    the buffer and reward models admit only its clients, each under its role. Empty:
    loopback only, and roles prove themselves with the run directory's tokens."""
    client_key: str = ""
    """Which client of ``keys_dir`` (``clients/NAME``) this machine's processes are; empty:
    the only one there."""
    max_message_mb: PosInt = 256
    """The largest frame (MiB) the buffer and the reward models take
    from a client; one that sends more is disconnected. A rollout's tensors each travel in
    a frame of their own, and small ones packed together."""


class GeneratorConfig(_Section):
    engine: Literal["vllm", "hf"] = "vllm"
    """What samples: ``vllm`` (an AsyncLLM engine, continuous batching) or ``hf`` (the
    model in the generator's own process, sampled with transformers in waves: no engine
    processes to start, for models too small for vLLM's fixed costs; docs/engines.md)."""
    count: PosInt | None = None
    """Number of generator processes (one vLLM engine each). Empty: one per group of
    ``placement.generators``; a number that disagrees with those groups is an error."""
    group_size: PosInt = 8
    """Samples per prompt (the GRPO / RLOO group; 1 suits gae and reinforce_plus_plus,
    whose baselines are not per prompt)."""
    max_new_tokens: PosInt = 6
    """Generation length cap."""
    temperature: PosFloat = 1.0
    """Sampling temperature; the learner computes its log-probs at the same temperature."""
    top_p: Annotated[float, msgspec.Meta(gt=0, le=1)] = 1.0
    """Nucleus sampling (1.0: off). pi_behav is then the truncated distribution; the
    off-policy correction absorbs the difference from the learner's."""
    top_k: NonNegInt = 0
    """Sample from the k most likely tokens (0: off)."""
    stop: list[str] = []
    """Stop strings (not included in the response); the tokenizer's EOS always stops."""
    max_inflight_groups: PosInt = 8
    """Prompt groups a generator keeps in its engine at once (continuous batching depth);
    as many more, already sampled, may be waiting for their scores."""
    kv_cache_mb: PosInt = 64
    """KV-cache size per engine, MiB."""
    max_model_len: PosInt = 64
    """Longest prompt + response the engine accepts."""
    gpu_memory_utilization: Fraction = 0.5
    """Fraction of GPU memory vLLM may take (GPU only)."""
    max_restarts: NonNegInt = 3
    """Times the launcher starts a generator process again after it died (``launcher:
    local``), after 1 s, then 2, 4, ... s (at most 30 s); the run stops at the next death.
    Its groups are issued again and the weight-sync group is rebuilt with it
    (docs/faults.md)."""


class ToolConfig(_Section):
    function: str
    """The tool, ``package.module:function``: a function (plain or ``async def``) or a
    callable object, called with the model's arguments as keywords; its result (a string,
    or anything JSON can write) is what the model reads (docs/agents.md)."""
    schema: dict[str, Any] = {}
    """Its OpenAI function schema (``{name, description, parameters}``, or the whole
    ``{type: function, function: {...}}``); empty: derived from the function's type hints
    and docstring."""
    args: dict[str, Any] = {}
    """Given: ``function`` is a factory (a class, or a function that builds the tool) called
    once per generator with these keyword arguments, and the callable object it returns
    is the tool, its schema derived from its ``__call__`` (the sandboxed Python tool:
    ``verl_async.tools.sandbox:python_tool`` with its limits, docs/agents.md)."""
    max_concurrent: NonNegInt = 0
    """Calls of this tool that may run at once in one generator (a sandbox or an API that
    allows only so many); more wait their turn within their deadline. 0: no limit."""


class EnvironmentConfig(_Section):
    env: str
    """The environment class, ``package.module:Class`` (importable, as for ``function``
    reward sources): one instance per episode (docs/multi_turn.md).
    ``verl_async.envs.tools:ToolAgent`` is the plain tool-calling loop: tools, and no
    environment of its own (docs/agents.md)."""
    args: dict[str, Any] = {}
    """Keyword arguments of the class's constructor."""
    data_sources: list[str] = []
    """The data sources whose prompts run as episodes of this environment (empty: every
    source no other environment names)."""
    tools: list[ToolConfig] = []
    """Tools the model may call in these episodes, in the standard form: their schemas go
    into the prompt through the chat template's ``tools`` argument, a turn's calls are
    parsed by ``multiturn.tool_parser`` and answered as ``role: tool`` messages; a turn
    without a call goes to the environment's ``step`` (docs/agents.md)."""
    methods_as_tools: bool = False
    """The environment's public methods (all but ``reset``, ``step`` and ``close``) are tools
    too, bound to the episode's instance (TRL's ``environment_factory``); they run on the
    instance's thread, one at a time."""


MAX_AGENT_CALLS = 256  # the bound of ``multiturn.agents[i].max_calls``
MAX_TURN_CALLS = 64  # the calls a parser reads in one turn (verl_async/tools/parsers.py)


class AgentConfig(_Section):
    agent: str
    """An agent program, ``package.module:function``: ``async def agent(client, row)``
    where ``client`` is an ``openai.AsyncOpenAI`` whose base URL is this generator's chat
    endpoint (one per episode) and ``row`` the prompt's ``EnvRow``; it returns the
    episode's reward (a number) or None (docs/agents.md)."""
    args: dict[str, Any] = {}
    """Keyword arguments passed to the agent after ``client`` and ``row``."""
    data_sources: list[str] = []
    """The data sources whose prompts this agent runs (empty: every source no environment
    or other agent names)."""
    max_calls: Annotated[int, msgspec.Meta(ge=1, le=MAX_AGENT_CALLS)] = 16
    """Chat-completions calls one episode may make; later ones are refused (HTTP 400).
    Each call gives at most one sample, so the largest ``max_calls`` of the run is also
    the most samples the buffer takes from one episode. At most 256: one group may hold
    ``generators.group_size`` times this many samples, pushed in one message and trained
    in one step."""


class MultiTurnConfig(_Section):
    environments: list[EnvironmentConfig] = []
    """Environments that turn prompts into multi-turn episodes (tool calls, feedback,
    games). Empty: every prompt gets one response."""
    agents: list[AgentConfig] = []
    """Agent programs that run prompts as episodes through this generator's
    OpenAI-compatible endpoint, recorded token for token (docs/agents.md)."""
    max_turns: PosInt = 4
    """Sampled turns an episode may take (each at most ``generators.max_new_tokens``)."""
    max_observation_tokens: PosInt = 256
    """Tokens one observation may add; a longer one is cut to this and counted as a tool
    error."""
    max_observation_messages: PosInt = 16
    """Messages one observation may hold; a step that returns more gets an error
    observation instead, counted as a tool error."""
    max_episode_tokens: PosInt = 1024
    """Prompt plus every turn and observation; an observation that would overflow it ends
    the episode before it is appended. At most ``generators.max_model_len``; the prompt
    plus one turn of ``generators.max_new_tokens`` must fit in it (``data.max_prompt_length``)."""
    step_timeout_s: PosFloat = 30.0
    """Deadline of one environment call (``reset``, ``step``); past it the turn ends with an
    error observation and the call is counted as a timeout. ``close`` gets as long of its
    own, even past ``episode_timeout_s``."""
    episode_timeout_s: PosFloat = 600.0
    """Deadline of one episode's environment calls together; past it the episode ends."""
    env_threads: NonNegInt = 0
    """Threads the instances of one environment may hold at once: each instance runs all
    its calls on a thread of its own, which a call past its deadline keeps until it
    returns; an instance that finds none free within its deadline runs without its
    environment, counted as a timeout. 0: twice the episodes a generator can have in
    flight (``generators.max_inflight_groups`` x the larger of ``generators.group_size``
    and ``eval.samples``)."""
    env_reward_weight: float = 1.0
    """Weight of the environment's per-turn rewards, added to the combined reward of the
    ``rewards`` sources (those score the final turn); finite in float32."""
    tool_parser: str = "hermes"
    """How a turn's tool calls are found: a parser by model family, ``hermes`` (Qwen2.5,
    Qwen3, ChatML: ``<tool_call>{json}</tool_call>``), ``llama3_json`` or ``qwen3_coder``
    (XML), vLLM's implementations (docs/agents.md)."""
    tool_template: str = ""
    """The chat template prompts and tool results are rendered with in episodes that have
    tools: empty, the tokenizer's own (it must take ``tools``); ``chatml_tools``, the
    shipped ChatML tool template (the hermes convention, for models whose template has no
    tool support, such as SmolLM2); or the path of a Jinja file."""
    max_parallel_calls: Annotated[int, msgspec.Meta(ge=1, le=MAX_TURN_CALLS)] = 4
    """Tool calls of one turn that run (at once); each call past it is answered with an
    error message and counted as a tool error. At most 64: a turn with more calls than
    that is a parse error (the parsers read no more), so a larger bound would never run."""
    max_tool_response_tokens: PosInt = 256
    """Tokens one tool result may take; a longer one is cut (marked, and counted as a
    tool error). The whole observation is still bounded by ``max_observation_tokens``."""

    @property
    def has_episodes(self) -> bool:
        """Whether some prompts run as episodes (of an environment or an agent)."""
        return bool(self.environments or self.agents)


class LearnerConfig(_Section):
    lr: PosFloat = 5e-4
    """AdamW learning rate."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """AdamW weight decay."""
    grad_clip: PosFloat = 1.0
    """Max gradient norm."""
    groups_per_step: PosInt = 8
    """Prompt groups per learner step (B in the admission rule of verl_async/staleness.py)."""
    prefetch: bool = True
    """Fetch the next batch in a background thread while the current step trains (pinned
    host memory on CUDA); false: fetch each batch when the step needs it."""
    max_tokens_per_microbatch: NonNegInt = 0
    """Gradient accumulation by token budget: each minibatch runs in micro-batches of at
    most this many padded tokens (rows x the longest row's tokens; rows of like length
    go together), one optimizer step per minibatch; 0: one pass per minibatch."""
    seed: int = 0
    """Torch seed of the learner."""
    warmup_steps: NonNegInt = 0
    """Linear learning-rate warm-up over this many steps, then constant (0: constant from the start)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (less memory, ~30 % more compute)."""
    compile: bool = False
    """torch.compile each decoder layer in place (the head stays eager; docs/gpu.md). The
    first two steps compile a few graphs (static, then with the sizes that vary dynamic;
    30-60 s each for a small model on 2 CPU cores), later steps reuse them. Pays where
    the step is launch-bound (GPUs), not on CPUs."""
    liger: bool = False
    """Liger's Triton kernels for RoPE, RMSNorm and SwiGLU in the policy (CUDA learners
    only; ``pip install liger-kernel``, part of the ``gpu`` extra). The log-probs stay on
    the chunked head (``logprob_chunk_tokens``): Liger's fused cross-entropy returns a
    loss, where the learner needs each token's log-prob."""
    cpu_offload: bool = False
    """FSDP2 keeps parameters, gradients and AdamW state in host memory and moves each
    decoder layer to the device for its forward and backward (CPUOffloadPolicy; the
    optimizer steps on the CPU). A single learner rank is then sharded as a group of one
    too. For a CUDA learner whose weights and optimizer state outgrow the GPU; on CPU
    learners it runs but saves nothing (the tensors are in host memory already)."""
    share_prefix: bool = True
    """Rows of a pass that start with the same prompt (a group's samples) compute it once:
    they are packed into one sequence, the prompt first, each sample's own tokens after
    it, with an attention mask that keeps samples apart (learners/logprobs.py). The same
    log-probs and gradients to float precision; used where it computes at most 80 % of
    the padded batch's positions, with sdpa or eager attention, without gradient
    checkpointing, and where a packed row fits in the model's sliding window. False: every
    row computes its whole sequence."""
    logprob_chunk_tokens: NonNegInt = 1024
    """Positions whose logits exist at once when the learner computes log-probs and
    entropies: the head runs on the masked positions' last hidden states in chunks of
    this many, each recomputed in backward, so the [tokens x vocabulary] logits never
    exist whole (prime-rl's fused_lm_head_token_chunk_size; learners/logprobs.py). Same
    values and gradients; 0: the model's own head over every kept position at once."""
    fused_head: bool = False
    """Fuse the head with its log-probs and entropies (learners/fused_head.py): one
    autograd function runs the head and the log-softmax in chunks of
    ``logprob_chunk_tokens`` positions (0: one chunk) and keeps no logits for the
    backward, which recomputes each chunk once and forms the gradients of the hidden
    states and the head's weight directly (the chunked head recomputes every chunk but
    the first through activation checkpointing). Same values and gradients to float
    rounding."""
    padding_free: bool = False
    """Pack a pass's rows end to end (several rows or prompt groups per packed row, each
    token at its position in its own row) so no padding is computed: a block-diagonal
    causal mask with sdpa or eager attention (prompts still shared with share_prefix),
    position ids only with flash attention (rows not sharing prompts there). Same
    log-probs and gradients as the padded pass; not with gradient checkpointing."""
    keep_freed_memory: bool = True
    """A learner on CPUs keeps the memory it frees for its next allocations instead of
    returning it to the system (glibc's allocator: no separate mapping per large block, no
    trimming), so a step does not page-fault its activations in again; its resident memory
    then stays at the largest step's. No effect on CUDA learners (learners/setup.py:
    keep_freed_memory)."""


KLPenalty = Literal[
    "kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3",
    "kl+", "k1+", "abs+", "mse+", "k2+", "low_var_kl+", "k3+",
]  # fmt: skip
LossAggMode = Literal[
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
]


class KLConfig(_Section):
    """KL between the policy and a frozen reference (docs/algorithms.md)."""

    ref_path: str = ""
    """Reference weights; empty: the initial policy (``model.path`` or the built tiny model)."""
    in_reward: bool = False
    """Subtract coef * KL from each response token's reward (verl's use_kl_in_reward)."""
    penalty: KLPenalty = "kl"
    """Estimator of the in-reward KL: kl/k1, abs, mse/k2, low_var_kl/k3, or one of them with
    "+" (its value, the gradient of k2: docs/algorithms.md)."""
    coef: Annotated[float, msgspec.Meta(ge=0)] = 0.001
    """Initial in-reward KL coefficient."""
    controller: Literal["fixed", "adaptive"] = "fixed"
    """fixed: coef stays; adaptive: coef moves so the measured KL tracks ``target_kl``."""
    target_kl: PosFloat = 0.1
    """Adaptive controller's target KL per sequence."""
    horizon: PosInt = 10000
    """Adaptive controller's horizon in samples."""
    loss_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Weight of a KL loss term in the actor loss (0: off; verl's kl_loss_coef)."""
    loss_type: KLPenalty = "low_var_kl"
    """Estimator of the KL loss term (as ``penalty``; "k3+" is k3's value with k2's gradient)."""


# ----------------------------------------------------------------------------- on-policy distillation

DistillLossMode = Literal["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3", "forward_kl_topk"]


class TeacherConfig(_Section):
    """One teacher: frozen, scoring the student's sampled tokens (verl's ``teacher_models``
    entry)."""

    name: str
    """Name of the teacher in metrics (``distill/<name>/...``) and in errors."""
    path: str = ""
    """Hugging Face model directory. Empty: a tiny model built from ``tiny`` (a run whose
    ``model.path`` is empty, the student being the tiny model too)."""
    tiny: TinyModelConfig = msgspec.field(default_factory=TinyModelConfig)
    """Shape and seed of the tiny teacher built when ``path`` is empty; it keeps the
    student's vocabulary only with the same ``extra_words``."""
    data_sources: list[str] = []
    """The prompts' ``data_source`` values this teacher scores (verl's ``key``); empty: every
    source no other teacher names."""
    batch_size: PosInt = 8
    """Samples per forward pass of the teacher's process (``distillation.scoring: process``)."""


class DistillationConfig(_Section):
    """On-policy distillation: teachers score the student's own samples per token, and the
    actor's loss pulls the student towards them (docs/distillation.md)."""

    enabled: bool = False
    """Score every sampled token with a teacher and add the distillation term."""
    scoring: Literal["process", "learner"] = "process"
    """Where teachers score: ``process``, each teacher in a process of its own (on
    ``placement.teachers``, restarted when it dies) that a generator asks before it pushes a
    group, off the learner's critical path; ``learner``, in every learner rank beside the
    reference model (one no-grad pass per step; for a teacher small enough to share it)."""
    timeout_s: PosFloat = 120.0
    """A generator's wait for one teacher reply; past it the request is dropped and sent
    again (a teacher that died is restarted meanwhile), the group held until scored."""
    loss_mode: DistillLossMode = "k3"
    """Per-token divergence: kl/k1, abs, mse/k2, low_var_kl/k3 (reverse-KL estimators on the
    sampled token); forward_kl_topk (forward KL over the teacher's ``topk`` most likely
    tokens at each sampled position; teachers in the learner, not with learner.fused_head)."""
    topk: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 32
    """forward_kl_topk: how many of the teacher's most likely tokens each position compares
    (at most the vocabulary's size); each adds a log-prob and a token id per scored token
    to the step's batch."""
    log_prob_min_clamp: Annotated[float, msgspec.Meta(lt=0)] | None = None
    """forward_kl_topk: both models' top-k log-probs clamped below at this value before the
    KL (null: not clamped)."""
    use_task_rewards: bool = True
    """Keep the task's policy loss (rewards, entropy bonus, KL term) beside the distillation
    term; false: the distillation term alone is the loss."""
    distillation_loss_coef: NonNegFloat = 1.0
    """Weight of the distillation term when ``use_task_rewards`` (1 without)."""
    loss_max_clamp: PosFloat | None = None
    """Each token's divergence clamped to [-c, c] (null: not clamped)."""
    use_policy_gradient: bool = False
    """true: the negated divergence is each token's advantage in a PPO-clip loss (the
    Thinking Machines recipe; with k1 the advantage is teacher minus student log-prob);
    false: the divergence is minimised directly as a loss (k1/kl refused: its gradient does
    not depend on the teacher)."""
    clip_ratio_low: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2
    """Lower clip range of that PPO-clip loss (use_policy_gradient)."""
    clip_ratio_high: PosFloat = 0.2
    """Upper clip range of that PPO-clip loss (use_policy_gradient)."""
    teachers: list[TeacherConfig] = []
    """The teachers, each serving its data sources; every prompt's source must be served by
    exactly one, and each must use the student's tokenizer."""

    @property
    def processes(self) -> list[TeacherConfig]:
        """The teachers that run in processes of their own (none unless enabled and
        ``scoring`` is ``process``)."""
        return list(self.teachers) if self.enabled and self.scoring == "process" else []

    def teacher_of(self, data_source: str) -> int:
        """Index of the teacher scoring ``data_source``: the one naming it, else the one
        naming no source. ConfigError when none serves it."""
        fallback = None
        for i, teacher in enumerate(self.teachers):
            if data_source in teacher.data_sources:
                return i
            if not teacher.data_sources:
                fallback = i
        if fallback is None:
            raise ConfigError(
                f"bad value for 'distillation.teachers': no teacher serves data source "
                f"'{data_source}' (list it in a teacher's data_sources, or give one teacher "
                "no data_sources to serve the rest)"
            )
        return fallback


# ----------------------------------------------------------------------------- DAPO dynamic sampling


class FilterGroupsConfig(_Section):
    """``algo.filter_groups``: DAPO's dynamic sampling, done by the buffer as groups arrive
    (docs/algorithms.md, "DAPO dynamic sampling")."""

    enable: bool = False
    """Drop every returned group of two or more samples whose ``metric`` values are all
    equal (its GRPO advantages would all be 0); the step takes the next groups instead."""
    metric: str = "reward"
    """What must differ within a group: ``reward`` (every reward source's raw score and the
    environment's turn rewards) or the name of one reward source (its raw score)."""
    max_in_a_row: PosInt = 32
    """Most groups dropped in a row (in the order they reach the buffer); the next one that
    would be dropped is kept and trains anyway (``filter_groups/admitted_past_bound``), so a
    run where every group scores alike never stalls."""


PresetName = Literal[tuple(PRESETS)]  # verl's 19 preset names
Threshold = float | str


class RolloutCorrectionConfig(_Section):
    """verl's rollout correction (``algo.correction: rollout``; verl's
    ``algorithm.rollout_correction``): importance weights and rejection sampling between
    the learner's log-probs and the generators' (docs/algorithms.md). A key left unset
    takes the preset's value, else verl's default."""

    preset: PresetName | msgspec.UnsetType = msgspec.UNSET
    """One of verl's named presets (e.g. decoupled_seq_is_rs); keys set beside it may
    change its thresholds and rollout_is_batch_normalize, and must agree with the rest."""
    rollout_is: Literal["token", "sequence"] | None | msgspec.UnsetType = msgspec.UNSET
    """Importance-weight level: token, sequence, or null (none; verl's YAML default)."""
    rollout_is_threshold: Threshold | msgspec.UnsetType = msgspec.UNSET
    """U: weights truncated at U (default 2.0); "L_U": IcePop, weights outside [L, U] set
    to 0 (quote it in YAML or write both with a dot, "0.5_5.0")."""
    rollout_is_batch_normalize: bool | msgspec.UnsetType = msgspec.UNSET
    """Rescale the weights to mean 1 over the step's batch (all data-parallel ranks);
    default false."""
    rollout_rs: str | None | msgspec.UnsetType = msgspec.UNSET
    """Rejection sampling: comma-separated options that must all pass (token_k1/k2/k3,
    seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, seq_max_k2/k3), or null (none; the default)."""
    rollout_rs_threshold: Threshold | None | msgspec.UnsetType = msgspec.UNSET
    """One threshold for every rollout_rs option or one per option, comma-separated: a
    k1 option takes "L_U" or U (L = 1/U) on the ratio, k2/k3 one positive U."""
    bypass_mode: bool | msgspec.UnsetType = msgspec.UNSET
    """true: the ratio is pi_theta / pi_behav and the weights compare pi_theta with
    pi_behav (verl's bypass, our ``none``); false (default): pi_theta / pi_prox, weights
    pi_prox / pi_behav (decoupled)."""
    loss_type: Literal["ppo_clip", "reinforce"] | msgspec.UnsetType = msgspec.UNSET
    """bypass mode only: ppo_clip (default; the weights are computed for the metrics but
    not applied) or reinforce (-A log pi_theta times the weights)."""

    def explicit(self) -> dict[str, Any]:
        """The correction keys set in the config (the preset aside)."""
        names = (f for f in self.__struct_fields__ if f != "preset")
        return {f: getattr(self, f) for f in names if getattr(self, f) is not msgspec.UNSET}

    @property
    def is_set(self) -> bool:
        return self.preset is not msgspec.UNSET or bool(self.explicit())

    def settings(self) -> RolloutCorrection:
        """The resolved settings; SettingError (a ValueError) names a bad key."""
        preset = None if self.preset is msgspec.UNSET else self.preset
        return resolve(preset, self.explicit())


class AlgoConfig(_Section):
    correction: Literal["none", "tis", "decoupled", "rollout"] = "decoupled"
    """Off-policy correction: none (pi/pi_behav, verl's bypass mode), tis (truncated
    pi_prox/pi_behav), decoupled (AReaL), rollout (verl's rollout correction:
    ``algo.rollout_correction``); the weights multiply every loss mode's loss."""
    rollout_correction: RolloutCorrectionConfig = msgspec.field(
        default_factory=RolloutCorrectionConfig
    )
    """verl's rollout correction; read only with ``algo.correction: rollout`` (setting
    it otherwise is an error)."""
    clip_eps: Annotated[float, msgspec.Meta(gt=0, lt=1)] = 0.2
    """PPO ratio clip epsilon: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]."""
    clip_eps_high: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Upper clip epsilon (DAPO's clip-higher); empty means equal to clip_eps."""
    is_cap: Annotated[float, msgspec.Meta(ge=1)] = 2.0
    """Cap of the behaviour importance weight pi_prox/pi_behav (tis: truncated; decoupled:
    masked above); correction rollout reads its own thresholds instead."""
    minibatches: PosInt = 2
    """Optimizer steps per batch (the batch is split into this many minibatches)."""
    normalize_adv_std: bool = True
    """Divide advantages by a std: grpo by its group's (false gives Dr. GRPO); gae and
    reinforce_plus_plus by the batch's, i.e. whiten them (false: centre over the batch
    only). rloo has no division; gdpo always divides (true required)."""
    adv_estimator: Literal["grpo", "gae", "rloo", "reinforce_plus_plus", "gdpo"] = "grpo"
    """Advantage estimator (docs/algorithms.md): grpo (group-relative), gae (PPO with the
    ``critic``), rloo (leave-one-out baseline), reinforce_plus_plus (discounted returns
    whitened over the batch), gdpo (each reward source's raw score group-relative, then
    weighted by its ``weight``, summed and whitened over the batch; needs every source's
    ``normalize: none``, normalize_adv_std true and no kl.in_reward)."""
    gamma: Fraction = 1.0
    """Discount of gae and reinforce_plus_plus."""
    lam: Fraction = 1.0
    """GAE lambda."""
    clip_ratio_c: Annotated[float, msgspec.Meta(gt=1)] | None = 3.0
    """Dual-clip constant: for negative advantages the per-token loss is at most
    -A * clip_ratio_c (as verl; empty turns dual-clip off). dppo_tv and dppo_kl use it as
    the cap of their truncated ratio (empty: 20)."""
    loss_mode: str = "vanilla"
    """Policy loss (docs/algorithms.md): vanilla (PPO clip), dppo_tv, dppo_kl, gspo, sapo,
    gpg, clip_cov, kl_cov, geo_mean, dro, cispo, reinforce, or a function of yours as
    package.module:function (verl's actor.policy_loss.loss_mode)."""
    loss_agg_mode: LossAggMode = "token-mean"
    """How per-token losses become one number: token-mean, token-sum, seq-mean-token-sum,
    seq-mean-token-mean or seq-mean-token-sum-norm (docs/algorithms.md); gspo and sapo
    always use seq-mean-token-mean, geo_mean a plain mean over sequences."""
    loss_scale_factor: PosFloat | None = None
    """seq-mean-token-sum-norm's constant divisor; empty: generators.max_new_tokens (the
    response horizon, as verl divides by its padded response length), or
    multiturn.max_episode_tokens when the run has environments."""
    entropy_coeff: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Entropy bonus: the actor loss subtracts entropy_coeff times the aggregated entropy."""
    tau_pos: PosFloat = 1.0
    """sapo: temperature of the soft gate on tokens with a positive advantage."""
    tau_neg: PosFloat = 1.05
    """sapo: temperature of the soft gate on the other tokens."""
    clip_cov_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.0002
    """clip_cov: share of a micro-batch's tokens (at least one) whose gradient is dropped."""
    clip_cov_lb: float = 1.0
    """clip_cov: only tokens whose covariance of advantage and log-prob exceeds this are
    candidates."""
    clip_cov_ub: float = 5.0
    """clip_cov: ... and is below this (must exceed clip_cov_lb)."""
    kl_cov_ratio: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.0002
    """kl_cov: share of a micro-batch's tokens (at least one), those of largest covariance,
    that get the |log-ratio| penalty."""
    kl_cov_coef: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    """kl_cov: coefficient of that penalty (verl's policy_loss.ppo_kl_coef)."""
    dro_beta: PosFloat | None = None
    """dro: coefficient of the quadratic log-ratio penalty; required with loss_mode dro."""
    kl: KLConfig = msgspec.field(default_factory=KLConfig)
    """KL to a frozen reference policy, in the reward and/or as a loss term."""
    filter_groups: FilterGroupsConfig = msgspec.field(default_factory=FilterGroupsConfig)
    """DAPO's dynamic sampling: drop the groups whose samples all score alike."""

    @property
    def uses_reference(self) -> bool:
        return self.kl.in_reward or self.kl.loss_coef > 0


class CriticConfig(_Section):
    """The value model of ``algo.adv_estimator: gae``, trained in the learner process."""

    path: str = ""
    """Critic weights (a token-classification or causal-LM directory); empty: the
    policy's initial weights with a fresh scalar head."""
    lr: PosFloat = 1e-5
    """Critic learning rate (AdamW)."""
    weight_decay: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Critic AdamW weight decay."""
    grad_clip: PosFloat = 1.0
    """Critic gradient-norm clip."""
    cliprange_value: PosFloat = 0.5
    """New values are clipped to old value +- this in the value loss (as verl)."""
    warmup_steps: NonNegInt = 0
    """The first N steps train only the critic; the actor's weights stay as they are."""


class EvalConfig(_Section):
    every_steps: NonNegInt = 0
    """Score ``data.val_path`` with the current weights every N steps, before the first step
    and after the last (0: never). Generators sample the eval prompts beside training work."""
    samples: PosInt = 1
    """Samples per eval prompt."""
    temperature: Annotated[float, msgspec.Meta(ge=0)] = 0.0
    """Eval sampling temperature (0: greedy)."""
    max_prompts: NonNegInt = 0
    """Evaluate at most this many validation prompts, the first ones (0: all)."""
    timeout_s: PosFloat = 600.0
    """The learner waits at most this long for the final evaluation before it stops."""


class StalenessConfig(_Section):
    max: NonNegInt = 2
    """eta: no sample older than this many versions ever enters a gradient step; 0 = synchronous."""


class WeightsConfig(_Section):
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    """Weight-sync backend: auto = nccl with CUDA, gloo otherwise."""
    mode: Literal["keep", "abort"] = "keep"
    """In-flight requests at a swap. keep: pause with requests and their KV cache kept, swap,
    resume (a prefix computed by the old weights is attended to by the new ones). abort: abort
    them and resubmit prompt + tokens so far, so the new weights re-read the prefix (costs a
    re-prefill). Either way every token carries the version that sampled it."""
    bucket_mb: PosInt = 64
    """Weights are broadcast in packed buckets of this size."""
    overlap: bool = True
    """Broadcast in a background thread while the next step trains (holds one packed copy
    of the weights); false broadcasts bucket by bucket inside the step (one bucket)."""
    delta: bool | Literal["network"] = "network"
    """Send only the weights whose value in the generator's dtype changed since the last
    update (indices or a bitmap plus the new values, per bucket; a bucket goes whole where
    that is smaller). A generator that joins, restarts or missed an update gets whole
    buckets; every update is bit-identical to a whole one (docs/scaling.md). network: only
    updates that cross the network (through the same-host memory file a whole copy costs
    less than finding what changed); true: every route; false: every update sends every
    weight. A CUDA IPC group always sends whole updates, and a float32 ``model.dtype`` in
    effect does too (a step changes nearly every float32 word)."""
    full_every: NonNegInt = 50
    """With ``delta``: every this many updates of a weight-sync group go whole (0: only
    when a generator needs it)."""
    digest_every: NonNegInt = 10
    """With ``delta``: every this many updates each generator's copy of the weights is
    compared, bucket by bucket, with the learner's by a CRC-32 of its bytes; a bucket
    that differs is sent whole and counted (``weight_heals``). 0: never checked."""
    shared_memory: bool = True
    """When every generator worker runs on learner rank 0's host (checked when the group
    forms), updates go through shared memory instead of the loopback network (gloo only;
    docs/scaling.md); false always uses the network."""
    timeout_s: PosFloat = 120.0
    """No side waits longer than this for one weight update (a broadcast, once the group is
    built)."""
    join_timeout_s: PosFloat = 600.0
    """How long the learner waits for every generator's engine to start and join the group,
    and a generator for the group's rendezvous (a restarted one waits for the learner's next
    publish first, without a deadline)."""
    port: Port = 0
    """TCPStore port of the weight-sync group; 0 picks a free one."""
    host: str = ""
    """Address learner rank 0 serves the weight-sync rendezvous on; every generator must
    reach it (default: buffer.host). Set it, with ``port``, when the learner runs on another
    machine than the buffer (``verl-async learner``); off loopback it needs
    ``buffer.keys_dir``, as the buffer's own address does (the rendezvous itself is not
    authenticated: docs/security.md)."""


class PlacementConfig(_Section):
    """Which devices each process gets (interpreted in verl_async/placement.py). A device is
    'cpu' (unpinned, may be shared), 'cpu:N' (pinned to core N) or 'cuda:N'; a pinned core
    or a GPU may serve one generator or learner process only."""

    generators: list[str | list[str]] = msgspec.field(default_factory=lambda: ["cpu:0"])
    """One entry per generator engine: a device, or a list of devices that one engine
    spans (CUDA: tensor parallelism over them; CPU cores: one engine bound to them)."""
    learners: list[str] = msgspec.field(default_factory=lambda: ["cpu:1"])
    """One learner rank per device; several ranks must be all CPU or all CUDA."""
    reward_models: list[str] = msgspec.field(default_factory=lambda: ["cpu"])
    """Device of each ``model`` reward source's process, reused round-robin."""
    teachers: list[str] = msgspec.field(default_factory=lambda: ["cpu"])
    """Device of each distillation teacher's process (``distillation.scoring: process``),
    reused round-robin."""
    colocate: bool = False
    """Let the generators share learner rank 0's GPU (a one-GPU machine: e.g. both on
    'cuda:0'; one learner rank). Weight updates then go by CUDA IPC over a gloo group
    (NCCL refuses two ranks on one device); give vLLM a ``gpu_memory_utilization`` that
    leaves the learner room. False: a GPU serves one process."""
    generator_nice: Annotated[int, msgspec.Meta(ge=0, le=19)] = 10
    """Scheduling niceness (0-19) of a generator whose CPU cores a learner rank may also
    use ('cpu' placements): the learner's threads then take a shared core first, so a
    generator working between updates cannot make every parallel region of the learner
    wait for its thread there. 0 leaves the priority alone; GPU and separate cores are
    never changed."""


class TrainerConfig(_Section):
    total_steps: PosInt = 400
    """Learner steps (= weight publications) in the run."""
    log_every: PosInt = 1
    """Progress line every N steps (metrics.jsonl gets every step)."""
    loggers: list[Literal["tensorboard", "wandb"]] = msgspec.field(
        default_factory=lambda: ["tensorboard"]
    )
    """Where each step's numbers go besides metrics.jsonl (always written): tensorboard
    (``<run_dir>/tensorboard``) and/or wandb (Weights & Biases; ``pip install
    'verl-async[wandb]'``; ``WANDB_MODE=offline`` without network). See docs/watching.md."""
    project: str = "verl-async"
    """W&B project of the run (with wandb in ``loggers``); the W&B run is named ``name``."""
    max_restarts: NonNegInt = 2
    """Times the run resumes by itself after its learner (any rank) or its buffer died: the
    launcher stops the other roles and resumes from the newest checkpoint that verifies (the
    run starts over if it has none yet), exactly once as with ``--resume``, after 1 s, then
    2, 4, ... s (at most 30 s). 0: such a death ends the run (docs/faults.md)."""


class CheckpointConfig(_Section):
    every_steps: NonNegInt = 0
    """Snapshot learner and buffer after every N-th step (0: never). The snapshot goes to host
    memory at the step barrier and a background writer persists it while training goes on."""
    keep_last: PosInt = 2
    """Committed checkpoints kept in ``<run_dir>/checkpoints``; older ones are deleted."""
    resume: bool = False
    """With ``--run-dir``: resume that run from its newest valid checkpoint if it has one,
    start it if the directory holds no run yet (the same command restarts a preempted job).
    A directory with a run's files (``metrics.jsonl``, ``tensorboard/``, ...) but no run's
    ``config.yaml`` is refused, and nothing in it is deleted."""
    write_timeout_s: PosFloat = 300.0
    """Longest wait for the previous checkpoint write before the next snapshot, or at exit
    (a launcher stopping the roles during a write stops the learner first and the buffer
    once the write has committed, at most this long later)."""


class RayConfig(_Section):
    """``launcher: ray``: the Ray cluster the roles run in as actors (docs/ray.md)."""

    address: str = ""
    """Cluster to join: "auto" or the head's HOST:PORT, from a node of it. Empty: start a
    Ray instance on this machine for the run and shut it down at the end."""
    timeout_s: PosFloat = 120.0
    """Longest wait for Ray to place each role (its placement group and actor) or answer."""


class RunConfig(_Section):
    name: str = "run"
    """Run name; the default run directory is runs/<name>-<timestamp>."""
    launcher: Literal["local", "ray"] = "local"
    """How ``train`` starts the roles: local processes, or Ray actors (``ray``, docs/ray.md)."""
    model: ModelConfig = msgspec.field(default_factory=ModelConfig)
    data: DataConfig = msgspec.field(default_factory=DataConfig)
    buffer: BufferConfig = msgspec.field(default_factory=BufferConfig)
    generators: GeneratorConfig = msgspec.field(default_factory=GeneratorConfig)
    learner: LearnerConfig = msgspec.field(default_factory=LearnerConfig)
    algo: AlgoConfig = msgspec.field(default_factory=AlgoConfig)
    critic: CriticConfig = msgspec.field(default_factory=CriticConfig)
    rewards: RewardsConfig = msgspec.field(default_factory=RewardsConfig)
    multiturn: MultiTurnConfig = msgspec.field(default_factory=MultiTurnConfig)
    eval: EvalConfig = msgspec.field(default_factory=EvalConfig)
    staleness: StalenessConfig = msgspec.field(default_factory=StalenessConfig)
    weights: WeightsConfig = msgspec.field(default_factory=WeightsConfig)
    placement: PlacementConfig = msgspec.field(default_factory=PlacementConfig)
    trainer: TrainerConfig = msgspec.field(default_factory=TrainerConfig)
    checkpoint: CheckpointConfig = msgspec.field(default_factory=CheckpointConfig)
    ray: RayConfig = msgspec.field(default_factory=RayConfig)
    distillation: DistillationConfig = msgspec.field(default_factory=DistillationConfig)
