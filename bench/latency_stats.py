"""The summary of a load run: throughput, latency percentiles and errors, from the requests' records."""
from __future__ import annotations

from collections import Counter

import numpy as np

from openai_request import RequestRecord

PERCENTILES = (50, 90, 99)


def distribution_ms(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}}
    ms = np.asarray(values) * 1000.0
    return {"mean": float(ms.mean()), **{f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES}}


def summarize(records: list[RequestRecord], duration: float) -> dict:
    ok = [r for r in records if r.ok]
    errors = Counter(str(r.status) if r.status != 200 else "stream error" for r in records if not r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors_by_status": dict(errors),
        "first_errors": sorted({r.error for r in records if not r.ok})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "output_throughput": output_tokens / duration if duration else 0.0,
        "total_token_throughput": (output_tokens + prompt_tokens) / duration if duration else 0.0,
        "mean_prompt_tokens": prompt_tokens / len(ok) if ok else 0.0,
        "mean_output_tokens": output_tokens / len(ok) if ok else 0.0,
        "ttft_ms": distribution_ms([r.ttft for r in ok if r.ttft is not None]),
        "tpot_ms": distribution_ms([r.tpot for r in ok if r.tpot is not None]),
        "itl_ms": distribution_ms([itl for r in ok for itl in r.itls]),
        "e2e_ms": distribution_ms([r.latency for r in ok]),
    }


def samples(records: list[RequestRecord]) -> dict[str, list[float]]:
    """The raw values (ms) behind each distribution, for plots."""
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": [r.ttft * 1000 for r in ok if r.ttft is not None],
        "tpot_ms": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "itl_ms": [itl * 1000 for r in ok for itl in r.itls],
        "e2e_ms": [r.latency * 1000 for r in ok],
    }
