"""kvtransfer: KV windows, append metadata, KV layouts (one per tensor-parallel rank:
``KVShards``), transfer plans and the NIXL agent.

Imports neither ``engine`` nor ``proto``. Importing this package does not load NIXL/UCX;
``TransferAgent`` loads them when the first agent is created.
"""

from .agent import TransferAgent, TransferError
from .layout import KVLayout
from .metadata import (
    AppendMetadataError,
    decode_append_metadata,
    decode_models,
    encode_append_metadata,
    encode_models,
    validate_append_metadata,
)
from .plan import PlanError, TransferPlan, check_plan, plan_transfer
from .shards import KVShard, KVShards
from .window import KVWindowError, resolve_kv_window, resolve_kv_window_end

__all__ = [
    "AppendMetadataError",
    "KVLayout",
    "KVShard",
    "KVShards",
    "KVWindowError",
    "PlanError",
    "TransferAgent",
    "TransferError",
    "TransferPlan",
    "check_plan",
    "decode_append_metadata",
    "decode_models",
    "encode_append_metadata",
    "encode_models",
    "plan_transfer",
    "resolve_kv_window",
    "resolve_kv_window_end",
    "validate_append_metadata",
]
