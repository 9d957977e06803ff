"""Every message that crosses a ZeroMQ socket, in one place.

Wire format of one message (a ZMQ multipart message):

    frame 0      msgpack(Envelope)   protocol version, request id, a tagged-union body
    frame 1..n   raw tensor bytes    referred to by ``TensorRef(dtype, shape, frame)``

Bodies are frozen ``msgspec.Struct``s tagged by class name. Tensors never go through
msgpack: the sender hands the tensor's buffer to ``send_multipart(copy=False)`` and the
receiver wraps the frame with ``numpy.frombuffer`` (zero copy). There is no pickle on
any path; a frame that does not decode raises ``ProtocolError`` for the server to turn
into an ``Error`` reply.
"""

from __future__ import annotations

import math
from typing import Any, Union

import msgspec
import numpy as np

PROTOCOL_VERSION = 8  # 8: a push takes each group on its own (``Dropped.refused``)
# 7: WeightUpdate carries learner rank 0's shared-memory offer
# 6: requests bound to roles (Error "forbidden"); clients prove a role

_DTYPES = {"float32", "float16", "int32", "int64", "uint8", "bool"}
# dtype -> name and name -> itemsize, looked up per tensor (``ndarray.dtype.name`` is slow).
_NAME_OF = {np.dtype(n): n for n in _DTYPES}
_ITEMSIZE = {n: np.dtype(n).itemsize for n in _DTYPES}


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


class _Msg(msgspec.Struct, frozen=True, tag=True, kw_only=True, forbid_unknown_fields=True):
    pass


class TensorRef(msgspec.Struct, frozen=True, array_like=True):
    """Where a tensor's bytes are: frame index (1-based, after the envelope) and byte offset."""

    dtype: str
    shape: tuple[int, ...]
    frame: int
    offset: int = 0


# ----------------------------------------------------------------------------- payloads


Message = dict[str, str]  # one chat message: {"role": ..., "content": ...}


class PromptGroup(msgspec.Struct, frozen=True, kw_only=True):
    """One prompt to be sampled ``group_size`` times; ``group_id`` is k in issue order
    (for evaluation prompts: the index in the validation set)."""

    group_id: int
    prompt_id: int
    epoch: int
    prompt_ids: list[int]  # [P] what the engine receives (chat template applied, if any)
    prompt: str | list[Message]  # as the dataset gives it: a string or chat messages
    ground_truth: str
    data_source: str = ""
    extra_info: dict[str, Any] = {}
    # The lease it was issued under (buffer/leases.py): its rollout names it, and its holder
    # renews it (``RenewLeases``). 0: not leased (evaluation prompts).
    lease: int = 0


EPISODE_BUDGETS = ("turns", "turn_tokens", "episode_tokens", "episode_timeout")
"""What ``EpisodeStats.budget`` may name besides "" (generators/episodes.py says when)."""


class EpisodeStats(msgspec.Struct, frozen=True, array_like=True):
    """What one multi-turn episode did (one per sample; the learner's ``multiturn/*``
    metrics are made from these)."""

    turns: int  # sampled turns
    tool_calls: int  # environment steps that ran a tool (the environment says)
    tool_errors: int  # environment calls that raised or whose observation was cut
    tool_timeouts: int  # environment calls past multiturn.step_timeout_s
    env_seconds: float  # wall time spent in the environment's reset and steps
    observation_tokens: int  # tokens of every observation appended
    budget: str  # "" or one of EPISODE_BUDGETS: the budget that ended it
    versions_spanned: int  # newest minus oldest weights version of its sampled tokens
    template_mismatch: bool  # the incremental tokens differ from a full render of the conversation
    env_reward: float  # the sum of the environment's per-turn rewards (before env_reward_weight)
    tool_parse_errors: int = 0  # turns whose tool calls could not be parsed (malformed)
    # An agent's episode through the chat endpoint may give several samples (a call that
    # rewrote the conversation starts a new one, counted in prefix_breaks): ``episode`` is
    # the index (0 .. group size - 1) of the episode this sample belongs to, its samples
    # consecutive; -1: one sample per episode, sample i is episode i.
    prefix_breaks: int = 0
    episode: int = -1


class RolloutGroup(msgspec.Struct, frozen=True, kw_only=True):
    """All samples of one prompt group, as produced by one generator.

    Samples are concatenated along the token axis; ``lengths[i]`` is sample i's length.
    A multi-turn sample's response is every token after the prompt: sampled turns and the
    observations between them. ``loss_mask`` is then 1 on sampled tokens and 0 on
    observation tokens, whose ``behav_logprobs`` are 0.0 and whose ``token_versions``
    repeat the version of the sampled token before them (placeholders nothing reads).
    """

    group_id: int
    prompt_id: int
    generator_id: int
    lease: int  # the lease of the issue it samples (``PromptGroup.lease``); taken only while live
    prompt_ids: TensorRef  # [P] int32, identical for every sample of the group
    response_ids: TensorRef  # [sum(lengths)] int32
    behav_logprobs: TensorRef  # [sum(lengths)] float32, vLLM processed_logprobs
    token_versions: TensorRef  # [sum(lengths)] int32, weights version of each token
    lengths: list[int]
    scores: list[list[float]]  # [S][N] raw score of each reward source (NaN: not routed here)
    failed: list[int]  # [S] samples whose score is the source's default after a failure
    data_source: str
    gen_seconds: float
    loss_mask: TensorRef | None = None  # [sum(lengths)] uint8, 1 = sampled; None: all sampled
    # [sum(lengths)] float32: the environment's reward of each turn (times
    # multiturn.env_reward_weight) at the turn's last sampled token, 0 elsewhere; None: none
    turn_rewards: TensorRef | None = None
    episodes: list[EpisodeStats] = []  # [N] multi-turn samples only
    # [sum(lengths)] float32: the distillation teacher's log-prob of each sampled token (0 on
    # observation tokens); None: no teacher process scored the group (TokenLogprobs)
    teacher_logprobs: TensorRef | None = None
    teacher_s: float = 0.0  # the generator's wait for those, from first request to reply
    teacher_busy_s: float = 0.0  # the part the teacher spent computing them


class EvalResult(msgspec.Struct, frozen=True, kw_only=True):
    """One evaluation prompt's samples, scored; versions are those of their first tokens."""

    group_id: int
    data_source: str
    scores: list[list[float]]  # [S][n] raw scores, as in RolloutGroup
    failed: list[int]  # [S]
    response_lengths: list[int]  # [n] tokens
    versions: list[int]  # [n] weights version that sampled each response's first token
    example: str  # the first sample's text (shown in logs)
    env_rewards: list[float] = []  # [n] multi-turn: each episode's summed environment reward
    turns: list[int] = []  # [n] multi-turn: each episode's sampled turns


class ParamSpec(msgspec.Struct, frozen=True, array_like=True):
    name: str
    dtype: str
    shape: tuple[int, ...]


class CudaIpc(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A CUDA IPC handle of learner rank 0's device buffer (verl_async/device_memory.py):
    what ``UntypedStorage._share_cuda_`` gives, field by field."""

    device: int
    handle: bytes
    size: int  # bytes of the storage
    offset: int  # bytes into the allocation
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes  # empty: none
    event_sync_required: bool


class MemoryOffer(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Learner rank 0's memory of a weight-sync epoch (verl_async/weight_sync.py): a memory
    file, which members on its host open at ``path`` and accept only if it is that
    process's memory file, of their own user, holding ``token``; or (``cuda`` set, ``path``
    empty) a device buffer members on its GPU open by its CUDA IPC handle and accept only
    if it holds ``token``. It travels only from the learner through the buffer
    (``AnnounceWeights``, learner-only) to the generators (``VersionStatus``), never
    through the weight-sync store, which any local process can write."""

    path: str  # /proc/<pid>/fd/<n>; "" for a device buffer
    token: str  # hex; the memory's first bytes until the epoch's first update is written
    pid: int  # learner rank 0's process id
    cuda: CudaIpc | None = None


class WeightUpdate(msgspec.Struct, frozen=True, kw_only=True):
    """Announces version ``version``; the bytes follow over the weight-sync group."""

    version: int
    params: list[ParamSpec]
    bucket_bytes: int
    epoch: int = 0  # the weight-sync group it goes over (buffer/sync_epochs.py)
    memory: MemoryOffer | None = None  # None: no shared memory offered (the network only)


class Refusal(msgspec.Struct, frozen=True, kw_only=True):
    """A group of a ``PushRollouts`` refused for what its rollout holds (``Dropped``)."""

    group_id: int
    reason: str  # the check it failed, naming the field (cut to a few hundred characters)
    ended: bool  # refused too often: done without training, never issued again


# ----------------------------------------------------------------------------- requests


class GetPrompts(_Msg):
    generator_id: int
    loaded_version: int
    max_groups: int
    evaluate: bool = True  # false: training prompts only (a generator's first batch)
    # This generator shares CPU cores with the learner: issue it nothing (training or
    # evaluation prompts) while the learner trains its first batch (``Prompts.deferred``).
    defer_to_learner: bool = False


class PushRollouts(_Msg):
    """Finished groups, as many as were ready (one message amortises the per-message cost).

    Each group is taken or refused on its own (``Dropped`` names those not taken): one
    group's content costs that group alone. A message that is wrong as a whole (a group
    not in flight to its sender, under another lease or generator id, named twice) is
    answered ``Error`` and records nothing.
    """

    groups: list[RolloutGroup]


class RenewLeases(_Msg):
    """From a generator, every third of ``buffer.lease_timeout_s``: the leases of the groups
    it is still sampling, scoring or pushing. Each one this connection holds runs
    ``lease_timeout_s`` from now again, up to ``buffer.lease_max_s`` after its issue; the
    others change nothing. Reply ``Renewed``."""

    leases: list[int]


class PushEval(_Msg):
    """Scores of evaluation prompts of round ``round`` (no tokens: they never train)."""

    round: int
    results: list[EvalResult]


class PollVersion(_Msg):
    """Long poll: reply when the target version exceeds ``loaded_version``, when weights
    were announced over a newer weight-sync epoch than ``sync_epoch``, or at ``wait_s``."""

    generator_id: int
    loaded_version: int
    wait_s: float
    sync_epoch: int = 0


class JoinSync(_Msg):
    """From a generator whose engine is up: which weight-sync epoch its workers join
    (``SyncEpoch.wanted``). Sent again under the same id, it announces a restart."""

    generator_id: int


class SyncStatus(_Msg):
    """From learner rank 0: the group of epoch ``formed`` is complete (-1: no news);
    ``regroup``: a broadcast failed, build a new one. Reply ``SyncEpoch``."""

    formed: int = -1
    regroup: bool = False


class GetBatch(_Msg):
    """Long poll for the shard of step ``step`` that belongs to ``rank``."""

    step: int
    rank: int
    world_size: int
    learner_version: int
    wait_s: float


class AnnounceWeights(_Msg):
    update: WeightUpdate


class GetStats(_Msg):
    pass


class StartEval(_Msg):
    """Queue the validation prompts as evaluation round ``round``; generators take them
    beside training work (no admission: evaluation never trains)."""

    round: int
    step: int
    version: int


class GetEval(_Msg):
    """Reply ``EvalReport`` once round ``round`` is complete, ``NotReady`` until then."""

    round: int


class ScoreItem(msgspec.Struct, frozen=True, kw_only=True):
    """One response for one rule-based reward source (index into ``rewards.sources``)."""

    source: int
    prompt: str | list[Message]
    response: str
    ground_truth: str
    data_source: str = ""
    extra_info: dict[str, Any] = {}


class ScoreRules(_Msg):
    """To a generator's scoring process: score each item; reply ``Scores``."""

    items: list[ScoreItem]


class ScoreConversations(_Msg):
    """To a reward-model process: score each conversation (prompt messages + the
    assistant's response as the last message); reply ``Scores``."""

    conversations: list[list[Message]]


class ScoreTokens(_Msg):
    """To a teacher's process: its log-prob of each sampled token of one group, at the
    sampling ``temperature``; reply ``TokenLogprobs``. The arrays are a ``RolloutGroup``'s:
    every sample is ``prompt_ids`` followed by its slice of ``response_ids``."""

    prompt_ids: TensorRef  # [P] int32
    response_ids: TensorRef  # [sum(lengths)] int32
    lengths: list[int]
    temperature: float
    loss_mask: TensorRef | None = None  # [sum(lengths)] uint8, 1 = sampled; None: all sampled


class SnapshotBuffer(_Msg):
    """Checkpoint barrier: ``step`` learner steps are done and version ``version`` is
    published. The buffer takes its cut as of step ``step`` now (groups already handed
    out for steps >= ``step`` go back into it) and replies ``Ack``; the files are encoded
    only when ``FetchSnapshot`` asks for them, off the learner's critical path."""

    step: int
    version: int


class FetchSnapshot(_Msg):
    """The files of the cut taken at ``SnapshotBuffer(step)``; reply ``BufferState``."""

    step: int


class Shutdown(_Msg):
    pass


class GetRun(_Msg):
    """What a role started on its own (``verl-async generator|learner --buffer ADDR``)
    needs to join the run; reply ``RunInfo``."""


# ----------------------------------------------------------------------------- replies


class Prompts(_Msg):
    groups: list[PromptGroup]
    blocked_by_admission: bool
    exhausted: bool
    eval_groups: list[PromptGroup] = []  # evaluation prompts of round ``eval_round``
    eval_round: int = -1
    # The version of the oldest evaluation round that still has prompts to hand out (-1:
    # none). A generator at that version keeps it loaded until the round is sampled.
    eval_version: int = -1
    # Nothing issued because the request deferred to the learner, which has been served its
    # first batch and announced no weights since: ask again once a version is announced.
    deferred: bool = False


class Ack(_Msg):
    pass


class Dropped(_Msg):
    """Reply to ``PushRollouts`` when some of its groups were not taken; every other group
    of the message was recorded, as with ``Ack``.

    ``group_ids``: their rollout names a lease that is over (``reason``: it ran out or its
    generator was restarted; the group was issued again, perhaps to this very connection
    under a new lease, or was returned by that newer copy). ``refused``: the buffer
    refused what their rollout holds (a field out of the run's bounds); each such group
    is taken back and issued again, first in line, or, refused too often
    (``Refusal.ended``), done without training. Neither is the sender's fault as a
    whole: it goes on."""

    group_ids: list[int]
    reason: str
    refused: list[Refusal] = []


class Renewed(_Msg):
    """Reply to ``RenewLeases``: ``lost`` are the leases named that this connection no
    longer holds (ran out, revoked, returned, or never its own): their rollouts would be
    dropped, so their holder stops working on them."""

    lost: list[int]


class SyncEpoch(_Msg):
    """The weight-sync epoch weights were last announced over, and the one to build
    (equal when none is wanted)."""

    current: int
    wanted: int


class VersionStatus(_Msg):
    target_version: int
    update: WeightUpdate | None
    stop: bool
    eval_version: int = -1  # as in ``Prompts``


class Batch(_Msg):
    """A whole step for one learner rank: sample-major arrays, concatenated over tokens.

    Samples come rank by rank: the first ``shard_sizes[0]`` are rank 0's shard, and so on
    (every rank receives the same message and trains on its own slice). It carries data
    and counts derived from it, no clocks: generator rates and admission time are in
    ``Stats``, and the learner measures its own wait for a batch."""

    step: int
    group_ids: list[int]
    sample_group: list[int]  # [N] group id of each sample
    prompt_lengths: list[int]  # [N]
    response_lengths: list[int]  # [N]
    prompt_ids: TensorRef  # [sum prompt_lengths] int32
    response_ids: TensorRef  # [sum response_lengths] int32
    behav_logprobs: TensorRef  # [sum response_lengths] float32
    token_versions: TensorRef  # [sum response_lengths] int32
    scores: list[list[float]]  # [N][S] raw score of each reward source (NaN: not routed)
    failed: list[int]  # [S] samples of this step whose source failed (default score used)
    data_sources: list[str]  # data_source of each of group_ids
    dropped_stale: int
    buffer_size: int
    group_prompts: list[int] = []  # prompt index of each of group_ids (the audit trail)
    group_generators: list[int] = []  # the generator that sampled each of group_ids
    prompts_skipped: int = 0  # prompts left out of the data set (longer than max_prompt_length)
    sample_index: list[int] = []  # [N] index of each sample within its group
    shard_sizes: list[int] = []  # [world_size] samples of each rank's shard, in order
    loss_mask: TensorRef | None = None  # [sum response_lengths] uint8; None: all sampled
    turn_rewards: TensorRef | None = None  # [sum response_lengths] float32; None: all zero
    # [sum response_lengths] float32, the teacher processes' log-probs; None: not scored there
    teacher_logprobs: TensorRef | None = None
    episodes: list[EpisodeStats | None] = []  # [N] or empty (no multi-turn sample in the step)
    # Dynamic sampling (buffer/filtering.py): the groups dropped between this step's first
    # and last group, their prompts, and the counts so far (this step included).
    filtered_groups: list[int] = []
    filtered_prompts: list[int] = []
    filtered_total: int = 0
    past_bound: int = 0  # of this step's groups, those kept past filter_groups.max_in_a_row
    past_bound_total: int = 0


class BufferState(_Msg):
    """The buffer's checkpoint files: name -> bytes (uint8 tensors in the frames)."""

    step: int
    files: dict[str, TensorRef]


class Scores(_Msg):
    """One score per item; ``errors[i]`` is non-empty when item i failed (its score is
    then the source's default)."""

    scores: list[float]
    errors: list[str] = []


class TokenLogprobs(_Msg):
    """A teacher's answer to ``ScoreTokens``."""

    logprobs: TensorRef  # [sum(lengths)] float32; 0 where loss_mask is 0
    busy_s: float  # the teacher's compute time for this request (its batch's, shared out)


class EvalReport(_Msg):
    round: int
    step: int
    version: int
    results: list[EvalResult]
    seconds: float  # from StartEval to the last result


class NotReady(_Msg):
    step: int
    missing_groups: int


class Stats(_Msg):
    """The buffer's counters (the reply to ``GetStats``), and what it measures about the
    generators: totals count from the buffer process's start (checkpoints do not carry
    them), so after a resume they start again from zero."""

    issued: int
    returned: int
    consumed: int  # groups trained or dropped (dynamic sampling): every id below it
    stored_groups: int
    target_version: int
    dropped_stale: int
    admission_blocked: int
    leases_expired: int = 0  # groups taken back from a holder that did not return them in time
    leases_renewed: int = 0  # renewals that extended a lease (RenewLeases)
    renewals_refused: int = 0  # renewals of a lease the connection no longer held (no effect)
    rollouts_dropped: int = 0  # rollouts that came after their lease was over (Dropped)
    rollouts_refused: int = 0  # rollouts refused for what they held (Dropped.refused)
    groups_ended: int = 0  # groups refused too often: done without training (buffer/ledger.py)
    generator_restarts: int = 0  # generator processes that joined again under a known id
    gen_tokens_per_s: float = 0.0  # generation rate over the last 20 s (buffer/telemetry.py)
    gen_blocked_s: float = 0.0  # generators' seconds refused by admission so far (all generators)
    gen_idle_s: float = 0.0  # the part of it with nothing in flight (engine idle)
    teacher_groups: int = 0  # groups taken that a teacher process scored
    teacher_s: float = 0.0  # their generators' waits for the scores, summed (RolloutGroup)
    teacher_busy_s: float = 0.0  # the part of those the teachers computed


class Error(_Msg):
    code: str
    message: str


class RunInfo(_Msg):
    """The run as the buffer's run directory holds it: ``config.yaml`` (resolved) and
    ``endpoints.json``, as text, and that directory's path on the buffer's machine."""

    config_yaml: str
    endpoints_json: str
    run_dir: str


Body = Union[  # noqa: UP007 (msgspec needs a runtime Union of tagged Structs)
    GetPrompts,
    PushRollouts,
    RenewLeases,
    PollVersion,
    GetBatch,
    AnnounceWeights,
    GetStats,
    StartEval,
    GetEval,
    PushEval,
    ScoreRules,
    ScoreConversations,
    ScoreTokens,
    Scores,
    TokenLogprobs,
    EvalReport,
    SnapshotBuffer,
    FetchSnapshot,
    Shutdown,
    GetRun,
    JoinSync,
    SyncStatus,
    Prompts,
    Ack,
    Dropped,
    Renewed,
    VersionStatus,
    Batch,
    BufferState,
    NotReady,
    Stats,
    Error,
    RunInfo,
    SyncEpoch,
]


class Envelope(msgspec.Struct, frozen=True, array_like=True):
    version: int
    request_id: int
    body: Body


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Envelope)


class Frames:
    """Collects tensors for one outgoing message and hands out ``TensorRef``s.

    A tensor of ``SMALL`` bytes or more gets a frame of its own and travels without a copy.
    Smaller ones are packed, 16-byte aligned, into one shared frame: ZeroMQ would copy them
    anyway, and every frame costs a Python object and a syscall's share on both ends, which
    dominates for rollouts of a few KiB.
    """

    SMALL = 1 << 16

    def __init__(self) -> None:
        self._frames: list[memoryview | None] = []  # None marks the packed frame's slot
        self._packed: bytearray | None = None
        self._packed_frame = 0

    def add(self, array: np.ndarray) -> TensorRef:
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)
        name = _NAME_OF.get(array.dtype)
        if name is None:
            raise ProtocolError(f"dtype {array.dtype} cannot travel as a frame")
        if array.nbytes >= self.SMALL:
            self._frames.append(memoryview(array).cast("B"))
            return TensorRef(name, array.shape, len(self._frames))
        if self._packed is None:
            self._packed = bytearray()
            self._frames.append(None)
            self._packed_frame = len(self._frames)
        offset = -(-len(self._packed) // 16) * 16
        self._packed.extend(bytes(offset - len(self._packed)))
        self._packed.extend(memoryview(array).cast("B"))
        return TensorRef(name, array.shape, self._packed_frame, offset)

    @property
    def buffers(self) -> list:
        """The frames in order, ready for ``send_multipart(copy=False)``."""
        return [self._packed if b is None else b for b in self._frames]


def encode(body: Body, request_id: int = 0, frames: Frames | None = None) -> list:
    """Body (+ frames) -> list of buffers for ``send_multipart(copy=False)``."""
    head = _encoder.encode(Envelope(PROTOCOL_VERSION, request_id, body))
    return [head, *(frames.buffers if frames else [])]


def decode(parts: list) -> tuple[Envelope, list]:
    """Multipart frames -> (envelope, tensor frames). Raises ProtocolError on bad input.

    The envelope is decoded once, typed; a message that does not decode is never decoded
    again: the version it claims (to name a version mismatch) is read from its first
    bytes alone, so a malformed message costs no more than one failed pass."""
    if not parts:
        raise ProtocolError("empty message")
    # Anything a peer sends must end as ProtocolError: DecodeError (and ValidationError)
    # are ValueErrors, so is the UnicodeDecodeError of a string that is not UTF-8, and
    # deep nesting raises RecursionError.
    try:
        env = _decoder.decode(parts[0])
    except (ValueError, RecursionError) as exc:
        claimed = _peek_version(parts[0])
        if claimed not in (None, PROTOCOL_VERSION):
            raise ProtocolError(
                f"protocol version {claimed} is not {PROTOCOL_VERSION}; "
                "run the same verl-async version on every process"
            ) from None
        raise ProtocolError(f"malformed message: {exc}") from None
    if env.version != PROTOCOL_VERSION:
        raise ProtocolError(f"protocol version {env.version} is not {PROTOCOL_VERSION}")
    return env, list(parts[1:])


_ARRAY_HEADS = {0xDC: 3, 0xDD: 5}  # msgpack array16 / array32: bytes before the first item
_INT_HEADS = {  # msgpack integer type byte -> (bytes that follow, signed)
    0xCC: (1, False), 0xCD: (2, False), 0xCE: (4, False), 0xCF: (8, False),
    0xD0: (1, True), 0xD1: (2, True), 0xD2: (4, True), 0xD3: (8, True),
}  # fmt: skip


def _peek_version(head: bytes | memoryview) -> int | None:
    """The first item of a msgpack array if it is an integer (an envelope's version),
    read from at most its first 14 bytes; None for anything else."""
    start = bytes(memoryview(head)[:14])
    if not start:
        return None
    kind = start[0]
    at = 1 if 0x90 <= kind <= 0x9F else _ARRAY_HEADS.get(kind)
    if at is None or len(start) <= at:
        return None
    item = start[at]
    if item <= 0x7F or item >= 0xE0:  # positive / negative fixint
        return item if item <= 0x7F else item - 0x100
    if item not in _INT_HEADS:
        return None
    size, signed = _INT_HEADS[item]
    raw = start[at + 1 : at + 1 + size]
    return int.from_bytes(raw, "big", signed=signed) if len(raw) == size else None


MAX_NDIM = 32
"""Dimensions a ``TensorRef`` may have (numpy 1.x's limit; every tensor we send is 1-D)."""


def tensor(ref: TensorRef, frames: list, keep: bool = False) -> np.ndarray:
    """The array a ``TensorRef`` points at (a view on the received frame, no copy).

    Everything in the ref comes from the peer, so each field is checked before numpy sees
    it: a bad ref raises ProtocolError, never numpy's own ValueError (which the buffer
    would have to tell apart from its own bugs). ``keep``: the caller holds on to the
    array after the message is handled; a view would keep its whole frame alive, so
    unless the array spans the frame it is copied out (small tensors share a packed
    frame, and a peer could pad a frame with bytes nothing reads).
    """
    if ref.dtype not in _DTYPES:
        raise ProtocolError(f"unknown tensor dtype {ref.dtype[:32]!r}")
    if not 1 <= ref.frame <= len(frames):
        raise ProtocolError(f"tensor frame {ref.frame} missing ({len(frames)} frames)")
    if len(ref.shape) > MAX_NDIM:
        raise ProtocolError(f"tensor has {len(ref.shape)} dimensions, at most {MAX_NDIM}")
    frame = frames[ref.frame - 1]
    buf = memoryview(frame.buffer if hasattr(frame, "buffer") else frame).cast("B")
    if any(d < 0 for d in ref.shape):
        raise ProtocolError(f"tensor shape {ref.shape} has a negative dimension")
    count = math.prod(ref.shape)
    nbytes = count * _ITEMSIZE[ref.dtype]
    if ref.offset < 0 or ref.offset + nbytes > len(buf):
        raise ProtocolError(
            f"tensor frame {ref.frame} holds {len(buf)} bytes; shape {ref.shape} of "
            f"{ref.dtype} at offset {ref.offset} needs {ref.offset + nbytes}"
        )
    array = np.frombuffer(buf, dtype=ref.dtype, count=count, offset=ref.offset)
    if keep and nbytes != len(buf):
        array = array.copy()
    try:
        return array.reshape(ref.shape)
    except ValueError:  # empty, with a dimension numpy cannot index: (0, 2**62)
        raise ProtocolError(f"tensor shape {ref.shape} is too large") from None


def vector(ref: TensorRef, frames: list, dtype: str, name: str, keep: bool = False) -> np.ndarray:
    """``tensor`` for a field that must be a 1-D array of ``dtype``; errors name ``name``.

    Without this a float32 array sent where token ids belong would be stored as it came
    and fail (or silently mean something else) only in the learner, steps later.
    """
    if ref.dtype != dtype or len(ref.shape) != 1:
        shape = ref.shape if len(ref.shape) <= MAX_NDIM else f"<{len(ref.shape)} dimensions>"
        raise ProtocolError(
            f"{name} must be a 1-D {dtype} tensor, got {ref.dtype[:32]!r} of shape {shape}"
        )
    try:
        return tensor(ref, frames, keep)
    except ProtocolError as exc:
        raise ProtocolError(f"{name}: {exc}") from None
