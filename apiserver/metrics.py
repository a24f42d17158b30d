"""Prometheus metrics that are right for the whole group whichever API server answers the scrape.

Each API server keeps its counters and histograms in a small file of float64s under the group's runtime
directory, mapped into memory and written only by its owner (an increment is one store, no lock). A scrape
reads every server's file and sums them; the supervisor removes the directory when the group ends. A
restarted server reopens its file, so its counters continue instead of starting over. Gauges of the moment
(requests in flight, live API servers) come from the group's shared state, where the supervisor clears the
slot of a server that died.
"""
from __future__ import annotations

import bisect
import glob
import mmap
import os

from ipc.shared_state import MAX_RANKS, MAX_SLOTS, GroupState

PREFIX = "supervise_"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
FINISH_REASONS = ("stop", "length", "abort", "error")
STATUS_CLASSES = ("2xx", "4xx", "5xx")
# The status codes a gRPC API server (--grpc) ends calls with.
GRPC_CODES = ("OK", "CANCELLED", "DEADLINE_EXCEEDED", "INVALID_ARGUMENT", "NOT_FOUND", "RESOURCE_EXHAUSTED", "UNIMPLEMENTED",
              "INTERNAL", "UNAVAILABLE", "UNAUTHENTICATED")

# Counter name -> (help, labels per slot). Each (name, label) pair is one float64 slot in the file.
_COUNTERS = {
    "http_requests_total": ("HTTP requests answered by the API servers, by status class.", [f'status="{s}"' for s in STATUS_CLASSES]),
    "request_success_total": ("Finished choices, by finish reason.", [f'finished_reason="{r}"' for r in FINISH_REASONS]),
    "prompt_tokens_total": ("Prompt tokens of finished requests.", [""]),
    "generation_tokens_total": ("Generated tokens of finished requests.", [""]),
    "requests_rejected_total": ("Requests refused by the admission limits (HTTP 503).", [""]),
    # Per data-parallel rank: the label is the rank (vLLM's `engine` label); only the group's ranks are shown.
    "engine_requests_total": ("Engine requests sent to each data-parallel rank, by every API server.",
                              [f'engine="{r}"' for r in range(MAX_RANKS)]),
    "grpc_requests_total": ("gRPC calls answered by the API servers (--grpc), by status code.",
                            [f'code="{c}"' for c in GRPC_CODES]),
}
# Gauges per rank, as the API server answering the scrape sees each engine (EngineClient.rank_views).
_RANK_GAUGES = {
    "engine_up": ("1 while the rank serves, 0 once it is down (its engine exited, its node went away).", "up"),
    "engine_draining": ("1 while the rank's node is stopping: it finishes its requests and is sent no new ones.",
                        "draining"),
    "engine_num_requests_running": ("Requests running in the rank's engine, as it last reported.", "num_running"),
    "engine_num_requests_waiting": ("Requests waiting in the rank's engine, as it last reported.", "num_waiting"),
    "engine_kv_cache_usage_perc": ("The rank's KV cache usage (0-1), as it last reported.", "kv_cache_usage"),
}
# --metrics-names vllm: the series that mean what vLLM's mean, under vLLM's names, for what reads those (vLLM's
# Grafana dashboards, the Gateway API Inference Extension's endpoint picker, autoscalers on the queue length); the
# others keep ours. vLLM's running and waiting gauges are per engine (rank), as ours.
VLLM_NAMES = {
    "request_success_total": "vllm:request_success_total",
    "prompt_tokens_total": "vllm:prompt_tokens_total",
    "generation_tokens_total": "vllm:generation_tokens_total",
    "e2e_request_latency_seconds": "vllm:e2e_request_latency_seconds",
    "time_to_first_token_seconds": "vllm:time_to_first_token_seconds",
    "engine_num_requests_running": "vllm:num_requests_running",
    "engine_num_requests_waiting": "vllm:num_requests_waiting",
    "engine_kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
}
_HISTOGRAMS = {
    "e2e_request_latency_seconds": "Seconds from a request's arrival to its last token.",
    "time_to_first_token_seconds": "Seconds from a request's arrival to its first token.",
}


def _layout() -> dict[tuple[str, str], int]:
    slots, at = {}, 0
    for name, (_, labels) in _COUNTERS.items():
        for label in labels:
            slots[(name, label)] = at
            at += 1
    for name in _HISTOGRAMS:
        for bound in (*LATENCY_BUCKETS, "+Inf"):
            slots[(name, f'le="{bound}"')] = at
            at += 1
        slots[(name, "sum")] = at
        slots[(name, "count")] = at + 1
        at += 2
    return slots


_SLOTS = _layout()
# Per histogram, the slots of its buckets in order, +Inf last (an observation finds its first bucket by bisection
# instead of formatting every bucket's key: this runs for every request).
_BUCKET_SLOTS = {name: [_SLOTS[(name, f'le="{bound}"')] for bound in (*LATENCY_BUCKETS, "+Inf")]
                 for name in ("e2e_request_latency_seconds", "time_to_first_token_seconds")}
_SIZE = len(_SLOTS) * 8


class Metrics:
    def __init__(self, runtime_dir: str, index: int, names: str = "supervise"):
        """`names`: one of ipc.config.METRICS_NAMES, whose names the exposition gives."""
        self._renamed = VLLM_NAMES if names == "vllm" else {}
        self._path = os.path.join(runtime_dir, f"metrics-{index}.bin") if runtime_dir else None
        if self._path:
            fd = os.open(self._path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                if os.fstat(fd).st_size != _SIZE:
                    os.ftruncate(fd, _SIZE)
                self._map = mmap.mmap(fd, _SIZE)
            finally:
                os.close(fd)
        else:
            self._map = mmap.mmap(-1, _SIZE)
        self._values = memoryview(self._map).cast("d")
        self._runtime_dir = runtime_dir
        self._status_slot = {s[0]: _SLOTS[("http_requests_total", f'status="{s}"')] for s in STATUS_CLASSES}
        self._grpc_slot = {c: _SLOTS[("grpc_requests_total", f'code="{c}"')] for c in GRPC_CODES}

    def count_status(self, status: int) -> None:
        slot = self._status_slot.get(str(status)[0])
        if slot is not None:
            self._values[slot] += 1

    def count_grpc(self, code: str) -> None:
        slot = self._grpc_slot.get(code)
        if slot is not None:
            self._values[slot] += 1

    def count_rejected(self) -> None:
        self._values[_SLOTS[("requests_rejected_total", "")]] += 1

    def count_routed(self, ranks: list[int]) -> None:
        for rank in ranks:
            self._values[_SLOTS[("engine_requests_total", f'engine="{rank}"')]] += 1

    def finished(self, finish_reasons: list[str | None], prompt_tokens: int, generated: int,
                 latency: float, first_token: float | None) -> None:
        values = self._values
        for reason in finish_reasons:
            slot = _SLOTS.get(("request_success_total", f'finished_reason="{reason}"'))
            if slot is not None:
                values[slot] += 1
        values[_SLOTS[("prompt_tokens_total", "")]] += prompt_tokens
        values[_SLOTS[("generation_tokens_total", "")]] += generated
        self._observe("e2e_request_latency_seconds", latency)
        if first_token is not None:
            self._observe("time_to_first_token_seconds", first_token)

    def _observe(self, name: str, seconds: float) -> None:
        values = self._values
        buckets = _BUCKET_SLOTS[name]  # cumulative: every bucket from the first bound >= seconds, and +Inf
        for slot in buckets[bisect.bisect_left(LATENCY_BUCKETS, seconds):]:
            values[slot] += 1
        values[_SLOTS[(name, "sum")]] += seconds
        values[_SLOTS[(name, "count")]] += 1

    def _exposed(self, name: str) -> str:
        return self._renamed.get(name, PREFIX + name)

    def _group_totals(self) -> list[float]:
        """Every API server's values, summed (this server's alone without a runtime directory)."""
        if not self._path:
            return list(self._values)
        totals = [0.0] * len(_SLOTS)
        for path in glob.glob(os.path.join(self._runtime_dir, "metrics-*.bin")):
            try:
                with open(path, "rb") as f:
                    data = f.read(_SIZE)
            except OSError:
                continue
            if len(data) == _SIZE:
                for i, value in enumerate(memoryview(data).cast("d")):
                    totals[i] += value
        return totals

    def exposition(self, group: GroupState | None, model_name: str, ranks: list[dict] = ()) -> str:
        """The Prometheus text format for the whole group; `ranks`: EngineClient.rank_views()."""
        totals = self._group_totals()
        model = f'model_name="{_escape(model_name)}"'
        served = {f'engine="{view["rank"]}"' for view in ranks}
        lines = []
        for name, (help_text, labels) in _COUNTERS.items():
            full = self._exposed(name)
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} counter"]
            for label in labels:
                if label.startswith("engine=") and label not in served:
                    continue
                all_labels = f"{model},{label}" if label else model
                lines.append(f"{full}{{{all_labels}}} {_number(totals[_SLOTS[(name, label)]])}")
        for name, help_text in _HISTOGRAMS.items():
            full = self._exposed(name)
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} histogram"]
            for bound in (*LATENCY_BUCKETS, "+Inf"):
                label = f'le="{bound}"'
                lines.append(f"{full}_bucket{{{model},{label}}} {_number(totals[_SLOTS[(name, label)]])}")
            lines.append(f"{full}_sum{{{model}}} {totals[_SLOTS[(name, 'sum')]]!r}")
            lines.append(f"{full}_count{{{model}}} {_number(totals[_SLOTS[(name, 'count')]])}")
        for name, (help_text, key) in _RANK_GAUGES.items():
            full = self._exposed(name)
            lines += [f"# HELP {full} {help_text}", f"# TYPE {full} gauge"]
            for view in ranks:
                lines.append(f'{full}{{{model},engine="{view["rank"]}"}} {_number(float(view[key]))}')
        if group is not None:
            live = [slot for slot in range(MAX_SLOTS) if group.pid(slot)]
            lines += [
                f"# HELP {PREFIX}num_requests_running Requests in flight in the engines, from every API server.",
                f"# TYPE {PREFIX}num_requests_running gauge",
                f"{PREFIX}num_requests_running{{{model}}} {sum(group.in_flight(s) for s in live)}",
                f"# HELP {PREFIX}api_servers Live API server processes.",
                f"# TYPE {PREFIX}api_servers gauge",
                f"{PREFIX}api_servers {len(live)}",
                f"# HELP {PREFIX}open_connections Open HTTP connections, over every API server.",
                f"# TYPE {PREFIX}open_connections gauge",
                f"{PREFIX}open_connections {sum(group.open_connections(s) for s in live)}",
            ]
        return "\n".join(lines) + "\n"

    def close(self) -> None:
        self._values.release()
        self._map.close()


def _number(value: float) -> str:
    return str(int(value)) if value.is_integer() else repr(value)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
