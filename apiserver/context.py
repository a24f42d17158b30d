"""Everything a request handler needs from its API server process, in one place."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from apiserver.admission import AdmissionControl
from apiserver.engine_client import EngineClient
from apiserver.grammar_checker import GrammarChecker
from apiserver.metrics import Metrics
from ipc.config import ServeConfig
from ipc.model_info import ModelInfo
from ipc.shared_state import GroupState

if TYPE_CHECKING:  # a type only: a gRPC API server has no renderer and must not import the tokenizer
    from apiserver.renderer import Renderer


@dataclass
class ServerContext:
    config: ServeConfig
    index: int
    model: ModelInfo
    renderer: Renderer | None  # None in a gRPC API server (--grpc): the gateway in front tokenizes
    engine: EngineClient
    group: GroupState | None
    admission: AdmissionControl
    metrics: Metrics
    model_name: str = ""
    openapi_routes: list = field(default_factory=list)  # (path, method, summary), for /openapi.json
    server_load: int = 0  # generation requests in flight here, counted with --enable-server-load-tracking
    created: int = field(default_factory=lambda: int(time.time()))
    _ranks_version: int = 0  # of the supervisor's rank marks, last taken
    grammars: GrammarChecker = field(init=False)  # builds and checks requests' grammars, in a process of its own

    def __post_init__(self):
        if not self.model_name:
            self.model_name = self.config.model_name
        self.grammars = GrammarChecker(f"supervise: GrammarChecker_{self.index}",
                                       self.config.structured_output_check_timeout,
                                       self.config.structured_output_checkers)

    def engine_dead_reason(self) -> str | None:
        """Why no engine can serve, if none can: each said ENGINE_DEAD, or the supervisor marked it down."""
        self.sync_down_ranks()
        return self.engine.dead_reason

    def unavailable_reason(self) -> str | None:
        """Why this server cannot take a new request now, if it cannot: every engine is down, silent or draining
        (/health's 503, gRPC's NOT_SERVING)."""
        return self.engine_dead_reason() or self.engine.unanswered_reason or self.engine.draining_reason

    def sync_down_ranks(self) -> None:
        """Take the ranks the supervisor marked down or draining in shared memory (one read while nothing
        changed)."""
        if self.group is None:
            return
        version = self.group.ranks_version()
        if version != self._ranks_version:
            self._ranks_version = version
            for rank, why in self.group.down_ranks().items():
                self.engine.mark_rank_down(rank, why)
            for rank in self.group.draining_ranks():
                self.engine.mark_rank_draining(rank)
