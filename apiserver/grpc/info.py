"""The answers about the model and the group: GetModelInfo, GetServerInfo, GetLoads, and GetTokenizer's bundle.

What the gateway (smg 1.13) reads, learned by pointing it at a server that logged every call: at start it calls
HealthCheck, GetModelInfo (it registers the model under `served_model_name`, and loads the tokenizer from
`tokenizer_path`/`model_path` when it can read that directory, else streams GetTokenizer's zip), GetServerInfo
and SubscribeKvEvents (UNIMPLEMENTED here: it then polls GetLoads, every 10 s by default, asking for the
sections "core", "disagg", "queues" and "memory"); then HealthCheck now and then.
"""
from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import time
import zipfile
from datetime import datetime, timezone
from importlib.metadata import PackageNotFoundError, version

from smg_grpc_proto import vllm_engine_pb2 as pb

from apiserver.context import ServerContext
from apiserver.grpc.status import invalid_argument
from ipc.shared_state import MAX_SLOTS

STATS_TIMEOUT = 10.0
TOKENIZER_CHUNK = 64 * 1024  # the chunk size smg's own servicers stream
# What a tokenizer needs, as smg's servicers bundle it (exact names, then patterns).
_TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json", "special_tokens_map.json",
    "vocab.json", "merges.txt", "tokenizer.model", "tiktoken.model", "chat_template.json", "chat_template.jinja",
)
_TOKENIZER_SUFFIXES = (".tiktoken", ".jinja", ".model")


def _package_version() -> str:
    try:
        return version("supervise")
    except PackageNotFoundError:
        return "0+unknown"


def model_info(ctx: ServerContext) -> pb.GetModelInfoResponse:
    model = ctx.model
    hf_config = _read_json(os.path.join(model.model_dir, "config.json"))
    return pb.GetModelInfoResponse(
        model_path=model.model_dir,
        is_generation=True,
        max_context_length=model.max_model_len,
        vocab_size=model.vocab_size,
        supports_vision=False,
        served_model_name=ctx.model_name,
        tokenizer_path=model.model_dir,
        model_type=hf_config.get("model_type") or "",
        architectures=hf_config.get("architectures") or [],
        eos_token_ids=list(model.eos_token_ids),
        pad_token_id=_int_or_zero(hf_config.get("pad_token_id")),
        bos_token_id=_int_or_zero(hf_config.get("bos_token_id")),
        max_req_input_len=model.max_model_len - 1,  # a prompt must leave room for one generated token
        default_sampling_params_json=json.dumps(model.generation_defaults) if model.generation_defaults else "",
    )


def server_info(ctx: ServerContext, started: float, last_arrival: float) -> pb.GetServerInfoResponse:
    group = ctx.group
    live = [slot for slot in range(MAX_SLOTS) if group.pid(slot)] if group is not None else []
    return pb.GetServerInfoResponse(
        active_requests=sum(group.in_flight(slot) for slot in live) if group is not None else ctx.engine.num_in_flight,
        is_paused=False,
        last_receive_timestamp=last_arrival,
        uptime_seconds=time.time() - started,
        server_type="vllm-grpc",  # the protocol's name for a vLLM-style servicer
        data_parallel_size=ctx.engine.num_engines,
        kv_cache_dtype="auto",
        block_size=ctx.model.block_size,
        model_dtype=f"torch.{ctx.model.dtype}" if ctx.model.dtype != "none" else "",
        max_num_seqs=ctx.config.max_num_seqs,
        constrained_decoding_start="first_token",  # no reasoning parser runs here: grammars start at once
    )


async def loads(ctx: ServerContext, request: pb.GetLoadsRequest) -> pb.GetLoadsResponse:
    """Each engine's running and waiting requests and KV cache use, asked of the engines themselves."""
    engine = ctx.engine
    positions = list(range(engine.num_engines))
    if request.HasField("dp_rank"):
        if request.dp_rank not in engine.ranks:
            served = ", ".join(map(str, engine.ranks))
            raise invalid_argument(f"`dp_rank` is {request.dp_rank}: this group serves ranks {served}")
        positions = [engine.ranks.index(request.dp_rank)]
    stats = await asyncio.gather(*(engine.call_utility(i, "stats", timeout=STATS_TIMEOUT) for i in positions))
    ranks = [engine.ranks[i] for i in positions]
    return pb.GetLoadsResponse(
        timestamp=datetime.now(timezone.utc).isoformat(),
        version=_package_version(),
        dp_rank_count=engine.num_engines,
        loads=[_scheduler_load(ctx, rank, s) for rank, s in zip(ranks, stats)],
    )


def _scheduler_load(ctx: ServerContext, rank: int, stats: dict) -> pb.SchedulerLoad:
    running, waiting = stats.get("num_running", 0), stats.get("num_waiting", 0)
    blocks, block_size = stats.get("num_kv_blocks", 0), ctx.model.block_size
    return pb.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=running,
        num_waiting_reqs=waiting,
        num_total_reqs=running + waiting,
        num_used_tokens=(blocks - stats.get("num_free_kv_blocks", blocks)) * block_size,
        max_total_num_tokens=blocks * block_size,
        token_usage=float(stats.get("kv_cache_usage", 0.0)),
        max_running_requests=ctx.config.max_num_seqs,
    )


class TokenizerBundle:
    """The model directory's tokenizer files as one zip, built once. Entries carry a fixed date, so every API
    server of the group streams the same bytes and the same SHA-256."""

    def __init__(self, model_dir: str):
        self._model_dir = model_dir
        self._data: bytes | None = None
        self.sha256 = ""

    def chunks(self) -> list[bytes]:
        if self._data is None:
            self._data = self._build()
            self.sha256 = hashlib.sha256(self._data).hexdigest()
        data = self._data
        return [data[i:i + TOKENIZER_CHUNK] for i in range(0, len(data), TOKENIZER_CHUNK)]

    def _build(self) -> bytes:
        names = sorted(name for name in os.listdir(self._model_dir)
                       if name in _TOKENIZER_FILES or name.endswith(_TOKENIZER_SUFFIXES))
        buffer = io.BytesIO()
        with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as bundle:
            for name in names:
                with open(os.path.join(self._model_dir, name), "rb") as f:
                    bundle.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), f.read(),
                                    compress_type=zipfile.ZIP_DEFLATED)
        if not names:
            raise FileNotFoundError(f"no tokenizer files in {self._model_dir}")
        return buffer.getvalue()


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _int_or_zero(value) -> int:
    return value if isinstance(value, int) else 0
