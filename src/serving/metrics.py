"""What the connector did, counted for vLLM's own metrics: the interval line a serving engine logs ("KV Transfer
metrics: handoffs_mapped=…") and Prometheus counters on `vllm serve`'s /metrics. Both need the engine's stats on
(`vllm serve`'s default; `LLM(disable_log_stats=False)`).

The scheduler side counts each request with kvrelay parameters once, as it finishes, from its record — the dict its
output carries under `kv_transfer_params["kvrelay"]`, so a dashboard and a request's own record never disagree:

    handoffs_mapped / handoffs_refused / handoffs_recomputed    the record's handoff status: mapped; refused before
                                                                anything loaded (an ordinary prefill); recomputed (a
                                                                late refusal: vLLM recomputed the span's blocks)
    mapped_tokens                                               the span each mapped handoff's record names (once,
                                                                however many loads a preempted one took)
    exports_published / exports_unfinished                      a sender's export: published, or its request
                                                                finished before its prefill did
    request_errors                                              parameters that did not parse, a span not re-keyed

A refusal's reason stays in the request's record and the engine's log (free text: no metric label). The scheduler
hands the counts to vLLM once per step (`KVRelayConnector.get_kv_connector_stats`) and starts again from zero;
vLLM sums the steps of a logging interval (`aggregate`), and the counts cross from the engine core to the frontend
as `data` (`KVRelayConnector.build_kv_connector_stats` rebuilds them there). A request aborted between steps is
counted at the next step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

OUTCOMES = ("mapped", "refused", "recomputed")  # a handoff record's status
COUNTS = (*(f"handoffs_{outcome}" for outcome in OUTCOMES), "mapped_tokens", "exports_published",
          "exports_unfinished", "request_errors")  # fmt: skip


def record_counts(record: dict) -> dict[str, int]:
    """One finished request's record → the counts it adds (every key of COUNTS). Called inside vLLM's scheduler, so
    it never raises: a status outside OUTCOMES (none is written today) counts nowhere."""
    counts = dict.fromkeys(COUNTS, 0)
    status = (record.get("handoff") or {}).get("status")
    if status in OUTCOMES:
        counts[f"handoffs_{status}"] = 1
    if status == "mapped":
        counts["mapped_tokens"] = int(record["handoff"].get("mapped", 0))
    if "export" in record:
        counts["exports_published" if record["export"] is not None else "exports_unfinished"] = 1
    counts["request_errors"] = int("error" in record)
    return counts


@dataclass
class KVRelayStats(KVConnectorStats):
    """The connector's counts since the last step (module docstring); `data` maps each name of COUNTS to a count."""

    def __post_init__(self) -> None:
        unknown = sorted(set(self.data) - set(COUNTS))
        if unknown:
            raise ValueError(f"kvrelay stats: unknown counts {unknown} (known: {list(COUNTS)})")
        self.data = {name: int(self.data.get(name, 0)) for name in COUNTS}

    def count(self, record: dict) -> None:
        """Add one finished request's record."""
        for name, value in record_counts(record).items():
            self.data[name] += value

    def reset(self) -> None:
        self.data = dict.fromkeys(COUNTS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVRelayStats:
        for name in COUNTS:
            self.data[name] += int(other.data.get(name, 0))
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVRelayPromMetrics(KVConnectorPromMetrics):
    """The counts as Prometheus counters, one child per engine: vllm:kvrelay_handoffs_total{outcome},
    vllm:kvrelay_mapped_tokens_total, vllm:kvrelay_exports_total{outcome}, vllm:kvrelay_request_errors_total."""

    def __init__(self, vllm_config, metric_types, labelnames: list[str], per_engine_labelvalues: dict[int, list]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        counter = lambda name, doc, extra=(): self._counter_cls(name=name, documentation=doc,
                                                                labelnames=[*labelnames, *extra])  # fmt: skip
        handoffs = counter("vllm:kvrelay_handoffs", "kvrelay handoffs by outcome: mapped, refused (an ordinary "
                           "prefill), recomputed (a late refusal)", ("outcome",))  # fmt: skip
        tokens = counter("vllm:kvrelay_mapped_tokens", "tokens loaded by mapped kvrelay handoffs")
        exports = counter("vllm:kvrelay_exports", "kvrelay sender exports: published, or unfinished (the request "
                          "ended before its prefill)", ("outcome",))  # fmt: skip
        errors = counter("vllm:kvrelay_request_errors", "kvrelay requests whose parameters did not parse or whose "
                         "span was not re-keyed")  # fmt: skip
        self._children: dict[int, dict[str, Any]] = {}
        for engine, values in per_engine_labelvalues.items():
            children = {f"handoffs_{o}": handoffs.labels(*values, o) for o in OUTCOMES}
            children |= {f"exports_{o}": exports.labels(*values, o) for o in ("published", "unfinished")}
            self._children[engine] = children | {"mapped_tokens": tokens.labels(*values),
                                                 "request_errors": errors.labels(*values)}  # fmt: skip

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            if name in COUNTS and value:
                self._children[engine_idx][name].inc(value)
