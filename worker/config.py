"""Worker configuration: one dataclass holding each role's flags (`pdserve prefill`,
`decode`, `serve`). Light to import: the CLI reads the default ports to build its parser,
also in the client-only install."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.decode.config import DecodeConfig
from pdserve.engine import EngineConfig
from pdserve.prefill.config import PrefillConfig
from pdserve.runtime.membership import MembershipConfig
from pdserve.runtime.server import ServerConfig

ROLES = {"prefill": ("prefill",), "decode": ("decode",), "both": ("prefill", "decode")}
DEFAULT_PORTS = {"prefill": 50061, "decode": 50062, "both": 50051}


@dataclass
class WorkerConfig:
    role: str  # "prefill" | "decode" | "both" (a key of ROLES)
    engine: EngineConfig
    server: ServerConfig = field(default_factory=ServerConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    membership: MembershipConfig = field(default_factory=MembershipConfig)
    metrics_port: int | None = None  # Prometheus /metrics over HTTP; None: none
    http_port: int | None = None  # role both: the OpenAI API and /metrics; None: none
    served_model_name: list[str] | None = None  # what clients call it, its own name first (None:
    # models.catalogue.served_name)
    chat_template: str | None = None  # role both: --chat-template's text (None: the model's own)
    tool_call_parser: str = "auto"  # role both: --tool-call-parser
    test_gates: str = ""  # request id prefix stopped at test gates (runtime/gates.py)
