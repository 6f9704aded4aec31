from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_JOINING: _ClassVar[Role]
    ROLE_ACTIVE: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_JOINING: Role
ROLE_ACTIVE: Role

class Endpoints(_message.Message):
    __slots__ = ("data_plane", "catchup", "http")
    DATA_PLANE_FIELD_NUMBER: _ClassVar[int]
    CATCHUP_FIELD_NUMBER: _ClassVar[int]
    HTTP_FIELD_NUMBER: _ClassVar[int]
    data_plane: str
    catchup: str
    http: str
    def __init__(self, data_plane: _Optional[str] = ..., catchup: _Optional[str] = ..., http: _Optional[str] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("replica_id", "incarnation", "role", "shard_count", "endpoints", "slot")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation: str
    role: Role
    shard_count: int
    endpoints: Endpoints
    slot: int
    def __init__(self, replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., shard_count: _Optional[int] = ..., endpoints: _Optional[_Union[Endpoints, _Mapping]] = ..., slot: _Optional[int] = ...) -> None: ...

class Epoch(_message.Message):
    __slots__ = ("job_id", "number", "members", "rendezvous", "created_unix", "reason", "plane", "lane_spread_from")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    LANE_SPREAD_FROM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    number: int
    members: _containers.RepeatedCompositeFieldContainer[Member]
    rendezvous: str
    created_unix: float
    reason: str
    plane: int
    lane_spread_from: int
    def __init__(self, job_id: _Optional[str] = ..., number: _Optional[int] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., rendezvous: _Optional[str] = ..., created_unix: _Optional[float] = ..., reason: _Optional[str] = ..., plane: _Optional[int] = ..., lane_spread_from: _Optional[int] = ...) -> None: ...

class RegisterRequest(_message.Message):
    __slots__ = ("job_id", "replica_id", "shard_count", "endpoints", "incarnation", "role", "last_epoch", "slot", "slots", "layout")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SHARD_COUNT_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    LAST_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SLOT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica_id: str
    shard_count: int
    endpoints: Endpoints
    incarnation: str
    role: Role
    last_epoch: int
    slot: int
    slots: int
    layout: str
    def __init__(self, job_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., shard_count: _Optional[int] = ..., endpoints: _Optional[_Union[Endpoints, _Mapping]] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., last_epoch: _Optional[int] = ..., slot: _Optional[int] = ..., slots: _Optional[int] = ..., layout: _Optional[str] = ...) -> None: ...

class RegisterResponse(_message.Message):
    __slots__ = ("incarnation", "role", "epoch", "heartbeat_interval_s", "heartbeat_timeout_s", "resume", "finished", "finished_step")
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_INTERVAL_S_FIELD_NUMBER: _ClassVar[int]
    HEARTBEAT_TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    RESUME_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STEP_FIELD_NUMBER: _ClassVar[int]
    incarnation: str
    role: Role
    epoch: Epoch
    heartbeat_interval_s: float
    heartbeat_timeout_s: float
    resume: bool
    finished: bool
    finished_step: int
    def __init__(self, incarnation: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., epoch: _Optional[_Union[Epoch, _Mapping]] = ..., heartbeat_interval_s: _Optional[float] = ..., heartbeat_timeout_s: _Optional[float] = ..., resume: _Optional[bool] = ..., finished: _Optional[bool] = ..., finished_step: _Optional[int] = ...) -> None: ...

class HeartbeatRequest(_message.Message):
    __slots__ = ("job_id", "replica_id", "incarnation", "step", "epoch", "digest_step", "digest", "pace_step", "compute_s", "wait_s", "busiest_rank", "busiest_s", "siblings_busy_s", "lane_wait_ms")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DIGEST_STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PACE_STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BUSIEST_RANK_FIELD_NUMBER: _ClassVar[int]
    BUSIEST_S_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    LANE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica_id: str
    incarnation: str
    step: int
    epoch: int
    digest_step: int
    digest: str
    pace_step: int
    compute_s: float
    wait_s: float
    busiest_rank: int
    busiest_s: float
    siblings_busy_s: float
    lane_wait_ms: bytes
    def __init__(self, job_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., step: _Optional[int] = ..., epoch: _Optional[int] = ..., digest_step: _Optional[int] = ..., digest: _Optional[str] = ..., pace_step: _Optional[int] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., busiest_rank: _Optional[int] = ..., busiest_s: _Optional[float] = ..., siblings_busy_s: _Optional[float] = ..., lane_wait_ms: _Optional[bytes] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("job_id", "after_epoch", "replica_id", "incarnation")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_epoch: int
    replica_id: str
    incarnation: str
    def __init__(self, job_id: _Optional[str] = ..., after_epoch: _Optional[int] = ..., replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("job_id", "reporter_replica_id", "reporter_incarnation", "suspect_replica_id", "epoch", "reason", "early")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTER_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    REPORTER_INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SUSPECT_REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    EARLY_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    reporter_replica_id: str
    reporter_incarnation: str
    suspect_replica_id: str
    epoch: int
    reason: str
    early: bool
    def __init__(self, job_id: _Optional[str] = ..., reporter_replica_id: _Optional[str] = ..., reporter_incarnation: _Optional[str] = ..., suspect_replica_id: _Optional[str] = ..., epoch: _Optional[int] = ..., reason: _Optional[str] = ..., early: _Optional[bool] = ...) -> None: ...

class FailureReportResponse(_message.Message):
    __slots__ = ("confirmed", "detail", "epoch")
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    confirmed: bool
    detail: str
    epoch: int
    def __init__(self, confirmed: _Optional[bool] = ..., detail: _Optional[str] = ..., epoch: _Optional[int] = ...) -> None: ...

class ReadyRequest(_message.Message):
    __slots__ = ("job_id", "replica_id", "incarnation", "role", "probe_compute_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PROBE_COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica_id: str
    incarnation: str
    role: Role
    probe_compute_s: float
    def __init__(self, job_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., probe_compute_s: _Optional[float] = ...) -> None: ...

class ReadyResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("job_id", "replica_id", "incarnation", "reason", "step")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    replica_id: str
    incarnation: str
    reason: str
    step: int
    def __init__(self, job_id: _Optional[str] = ..., replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., reason: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class LeaveResponse(_message.Message):
    __slots__ = ("epoch",)
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    def __init__(self, epoch: _Optional[int] = ...) -> None: ...

class SessionRequest(_message.Message):
    __slots__ = ("heartbeat", "after_epoch", "resync", "ranks")
    HEARTBEAT_FIELD_NUMBER: _ClassVar[int]
    AFTER_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RESYNC_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    heartbeat: HeartbeatRequest
    after_epoch: int
    resync: bool
    ranks: int
    def __init__(self, heartbeat: _Optional[_Union[HeartbeatRequest, _Mapping]] = ..., after_epoch: _Optional[int] = ..., resync: _Optional[bool] = ..., ranks: _Optional[int] = ...) -> None: ...

class EpochDelta(_message.Message):
    __slots__ = ("job_id", "number", "base", "upserted", "removed", "rendezvous", "created_unix", "reason", "plane", "lane_spread_from")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    BASE_FIELD_NUMBER: _ClassVar[int]
    UPSERTED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PLANE_FIELD_NUMBER: _ClassVar[int]
    LANE_SPREAD_FROM_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    number: int
    base: int
    upserted: _containers.RepeatedCompositeFieldContainer[Member]
    removed: _containers.RepeatedScalarFieldContainer[str]
    rendezvous: str
    created_unix: float
    reason: str
    plane: int
    lane_spread_from: int
    def __init__(self, job_id: _Optional[str] = ..., number: _Optional[int] = ..., base: _Optional[int] = ..., upserted: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., removed: _Optional[_Iterable[str]] = ..., rendezvous: _Optional[str] = ..., created_unix: _Optional[float] = ..., reason: _Optional[str] = ..., plane: _Optional[int] = ..., lane_spread_from: _Optional[int] = ...) -> None: ...

class SessionUpdate(_message.Message):
    __slots__ = ("epoch", "delta", "epoch_zlib")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    EPOCH_ZLIB_FIELD_NUMBER: _ClassVar[int]
    epoch: Epoch
    delta: EpochDelta
    epoch_zlib: bytes
    def __init__(self, epoch: _Optional[_Union[Epoch, _Mapping]] = ..., delta: _Optional[_Union[EpochDelta, _Mapping]] = ..., epoch_zlib: _Optional[bytes] = ...) -> None: ...

class StatusRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class MemberStatus(_message.Message):
    __slots__ = ("replica_id", "incarnation", "role", "in_epoch", "last_heartbeat_age_s", "step", "digest_step", "digest", "pace_step", "compute_s", "wait_s", "busiest_rank", "busiest_s", "siblings_busy_s", "lane_wait_ms")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    IN_EPOCH_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_AGE_S_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_STEP_FIELD_NUMBER: _ClassVar[int]
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    PACE_STEP_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_S_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    BUSIEST_RANK_FIELD_NUMBER: _ClassVar[int]
    BUSIEST_S_FIELD_NUMBER: _ClassVar[int]
    SIBLINGS_BUSY_S_FIELD_NUMBER: _ClassVar[int]
    LANE_WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    incarnation: str
    role: Role
    in_epoch: bool
    last_heartbeat_age_s: float
    step: int
    digest_step: int
    digest: str
    pace_step: int
    compute_s: float
    wait_s: float
    busiest_rank: int
    busiest_s: float
    siblings_busy_s: float
    lane_wait_ms: bytes
    def __init__(self, replica_id: _Optional[str] = ..., incarnation: _Optional[str] = ..., role: _Optional[_Union[Role, str]] = ..., in_epoch: _Optional[bool] = ..., last_heartbeat_age_s: _Optional[float] = ..., step: _Optional[int] = ..., digest_step: _Optional[int] = ..., digest: _Optional[str] = ..., pace_step: _Optional[int] = ..., compute_s: _Optional[float] = ..., wait_s: _Optional[float] = ..., busiest_rank: _Optional[int] = ..., busiest_s: _Optional[float] = ..., siblings_busy_s: _Optional[float] = ..., lane_wait_ms: _Optional[bytes] = ...) -> None: ...

class Straggler(_message.Message):
    __slots__ = ("replica_id", "slowdown", "others_wait_s", "since_step", "reports", "rank", "rank_busy_ratio")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    OTHERS_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    slowdown: float
    others_wait_s: float
    since_step: int
    reports: int
    rank: int
    rank_busy_ratio: float
    def __init__(self, replica_id: _Optional[str] = ..., slowdown: _Optional[float] = ..., others_wait_s: _Optional[float] = ..., since_step: _Optional[int] = ..., reports: _Optional[int] = ..., rank: _Optional[int] = ..., rank_busy_ratio: _Optional[float] = ...) -> None: ...

class SlowLink(_message.Message):
    __slots__ = ("replica_id", "rank", "own_wait_s", "others_wait_s", "since_step", "reports")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OWN_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    OTHERS_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    rank: int
    own_wait_s: float
    others_wait_s: float
    since_step: int
    reports: int
    def __init__(self, replica_id: _Optional[str] = ..., rank: _Optional[int] = ..., own_wait_s: _Optional[float] = ..., others_wait_s: _Optional[float] = ..., since_step: _Optional[int] = ..., reports: _Optional[int] = ...) -> None: ...

class ReplicaEvent(_message.Message):
    __slots__ = ("replica_id", "kind")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    kind: str
    def __init__(self, replica_id: _Optional[str] = ..., kind: _Optional[str] = ...) -> None: ...

class HistoryEntry(_message.Message):
    __slots__ = ("epoch", "created_unix", "reason", "members", "events")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    CREATED_UNIX_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    created_unix: float
    reason: str
    members: _containers.RepeatedScalarFieldContainer[str]
    events: _containers.RepeatedCompositeFieldContainer[ReplicaEvent]
    def __init__(self, epoch: _Optional[int] = ..., created_unix: _Optional[float] = ..., reason: _Optional[str] = ..., members: _Optional[_Iterable[str]] = ..., events: _Optional[_Iterable[_Union[ReplicaEvent, _Mapping]]] = ...) -> None: ...

class StatusResponse(_message.Message):
    __slots__ = ("epoch", "members", "history", "leader", "finished", "finished_step", "agreement", "stragglers", "slow_links", "waiting_slots", "orphan_steps", "orphans_carried")
    class OrphanStepsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_STEP_FIELD_NUMBER: _ClassVar[int]
    AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    SLOW_LINKS_FIELD_NUMBER: _ClassVar[int]
    WAITING_SLOTS_FIELD_NUMBER: _ClassVar[int]
    ORPHAN_STEPS_FIELD_NUMBER: _ClassVar[int]
    ORPHANS_CARRIED_FIELD_NUMBER: _ClassVar[int]
    epoch: Epoch
    members: _containers.RepeatedCompositeFieldContainer[MemberStatus]
    history: _containers.RepeatedCompositeFieldContainer[HistoryEntry]
    leader: bool
    finished: bool
    finished_step: int
    agreement: str
    stragglers: _containers.RepeatedCompositeFieldContainer[Straggler]
    slow_links: _containers.RepeatedCompositeFieldContainer[SlowLink]
    waiting_slots: _containers.RepeatedScalarFieldContainer[int]
    orphan_steps: _containers.ScalarMap[int, int]
    orphans_carried: bool
    def __init__(self, epoch: _Optional[_Union[Epoch, _Mapping]] = ..., members: _Optional[_Iterable[_Union[MemberStatus, _Mapping]]] = ..., history: _Optional[_Iterable[_Union[HistoryEntry, _Mapping]]] = ..., leader: _Optional[bool] = ..., finished: _Optional[bool] = ..., finished_step: _Optional[int] = ..., agreement: _Optional[str] = ..., stragglers: _Optional[_Iterable[_Union[Straggler, _Mapping]]] = ..., slow_links: _Optional[_Iterable[_Union[SlowLink, _Mapping]]] = ..., waiting_slots: _Optional[_Iterable[int]] = ..., orphan_steps: _Optional[_Mapping[int, int]] = ..., orphans_carried: _Optional[bool] = ...) -> None: ...

class RendezvousRequest(_message.Message):
    __slots__ = ("job_id", "namespace", "keys", "value", "expected", "amount", "timeout_s")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_FIELD_NUMBER: _ClassVar[int]
    AMOUNT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[str]
    value: bytes
    expected: bytes
    amount: int
    timeout_s: float
    def __init__(self, job_id: _Optional[str] = ..., namespace: _Optional[str] = ..., keys: _Optional[_Iterable[str]] = ..., value: _Optional[bytes] = ..., expected: _Optional[bytes] = ..., amount: _Optional[int] = ..., timeout_s: _Optional[float] = ...) -> None: ...

class RendezvousResponse(_message.Message):
    __slots__ = ("value", "number", "ok")
    VALUE_FIELD_NUMBER: _ClassVar[int]
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    value: bytes
    number: int
    ok: bool
    def __init__(self, value: _Optional[bytes] = ..., number: _Optional[int] = ..., ok: _Optional[bool] = ...) -> None: ...
