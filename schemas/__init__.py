"""OpenForge event schemas: pydantic models, versions, registry and JSON (de)serialization.

Every event is an immutable pydantic model with a schema name and major version. Kafka producers
call :func:`encode`, consumers call :func:`decode`; both go through the explicit registry, in
which every v1 event below is registered when this package is imported.
"""

from schemas._arrays import Logprobs, LossMask, PackedArray, RawBytes, TokenIds
from schemas._base import EventBase, FrozenModel, UtcDatetime
from schemas._common import Identifier, JsonObject, WeightVersionRange
from schemas._errors import (
    DeadLetterErrorType,
    DecodeError,
    DuplicateSchemaError,
    InvalidEventError,
    MissingSchemaHeaderError,
    RegistryError,
    UndecodableEventError,
    UnknownSchemaError,
    UnregisteredEventError,
)
from schemas.call.v1 import (
    ApiProtocol,
    CallChoice,
    CallStatus,
    CallTimings,
    CallUsage,
    ModelCallV1,
    NormalizedRequest,
)
from schemas.checkpoint.v1 import CheckpointAppliedV1, CheckpointV1, LearnerProgressV1, TopicOffset
from schemas.deadletter.v1 import DeadLetterV1
from schemas.export import event_json_schema, json_schemas, schema_file_name
from schemas.registry import (
    CONTENT_TYPE_HEADER,
    JSON_CONTENT_TYPE,
    SCHEMA_HEADER,
    VERSION_HEADER,
    EventRegistry,
    Headers,
    all_events,
    decode,
    default_registry,
    encode,
    register,
    resolve,
)
from schemas.reward.v1 import RewardV1
from schemas.rollout.v1 import Backend, RolloutEventV1, RolloutPhase, RolloutReason
from schemas.task.v1 import (
    ContainerLaunch,
    HarnessSpec,
    LocalLaunch,
    Resources,
    TaskV1,
    VerifierSpec,
)
from schemas.trajectory.v1 import FinalizeReason, MergeStats, TrajectorySample, TrajectoryV1

# The one place built-in events are registered: adding a version means adding it here.
for _event in (
    TaskV1,
    ModelCallV1,
    RolloutEventV1,
    RewardV1,
    TrajectoryV1,
    CheckpointV1,
    CheckpointAppliedV1,
    LearnerProgressV1,
    DeadLetterV1,
):
    register(_event)
del _event

__all__ = [
    "CONTENT_TYPE_HEADER",
    "JSON_CONTENT_TYPE",
    "SCHEMA_HEADER",
    "VERSION_HEADER",
    "ApiProtocol",
    "Backend",
    "CallChoice",
    "CallStatus",
    "CallTimings",
    "CallUsage",
    "CheckpointAppliedV1",
    "CheckpointV1",
    "ContainerLaunch",
    "DeadLetterErrorType",
    "DeadLetterV1",
    "DecodeError",
    "DuplicateSchemaError",
    "EventBase",
    "EventRegistry",
    "FinalizeReason",
    "FrozenModel",
    "HarnessSpec",
    "Headers",
    "Identifier",
    "InvalidEventError",
    "JsonObject",
    "LearnerProgressV1",
    "LocalLaunch",
    "Logprobs",
    "LossMask",
    "MergeStats",
    "MissingSchemaHeaderError",
    "ModelCallV1",
    "NormalizedRequest",
    "PackedArray",
    "RawBytes",
    "RegistryError",
    "Resources",
    "RewardV1",
    "RolloutEventV1",
    "RolloutPhase",
    "RolloutReason",
    "TaskV1",
    "TokenIds",
    "TopicOffset",
    "TrajectorySample",
    "TrajectoryV1",
    "UndecodableEventError",
    "UnknownSchemaError",
    "UnregisteredEventError",
    "UtcDatetime",
    "VerifierSpec",
    "WeightVersionRange",
    "all_events",
    "decode",
    "default_registry",
    "encode",
    "event_json_schema",
    "json_schemas",
    "register",
    "resolve",
    "schema_file_name",
]
