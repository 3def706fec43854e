"""Rollback replayed on a routed workload's own items (src/routed.py): every refusal kind, on the (history, turn) ids
the workload built, must be reported by the routed session, which then produces the greedy tokens and the target cache
of a session that never tried a transfer, bit for bit.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import NamedTuple

import torch

from src.artifact import Mapper
from src.eval.rollback import cache_max_abs_diff
from src.routed_runs import Run
from src.runtime.routing import RouteRefusedWarning, bind
from src.runtime.session import Session


class RefusalKind(NamedTuple):
    """One planted fault: the mapper bound, the words its refusal's reason holds, policy overrides, whether the source's
    cache is poisoned (a NaN in its last token), whether the route is refused at binding by design (its warning is
    the plant's, not the run's)."""

    mapper: Mapper
    reason: str
    overrides: dict | None = None
    poison: bool = False
    at_binding: bool = False


def _overflowing(mapper: Mapper) -> Mapper:
    """Finite coefficients that pass the artifact checks but overflow float32: non-finite mapped values."""
    weight = mapper.weight_v.clone()
    weight[-1] = 3e38
    return replace(mapper, weight_v=weight)


def rollback(
    run: Run, mapper: Mapper, replays: list[tuple[torch.Tensor, torch.Tensor]], max_new_tokens: int, bind_args
) -> dict[str, float]:
    """Every refusal kind on the workload's own (history, turn) ids: the routed session must report it — refused for
    that kind's own reason (`RefusalKind.reason` in the record's reason: a replay refused for another, say the length
    guard or a binding refusal, never reached the check it stands for) — and then produce the greedy tokens and the
    target cache of a session that never tried a transfer, bit for bit. The kinds planted in the map, the source or
    the guard run with the length guard off, so a mapper verified for shorter histories than the replays' still gets
    them checked. `rollback.<kind>` and `rollback_verified` are 1.0 when every replay holds; what failed is logged
    beside: `.refused` (every replay refused for the kind's reason), `.tokens_equal`, `.cache_max_abs_diff` (over
    replays and layers, inf when the lengths differ)."""
    manifest = mapper.manifest
    unguarded = {"length_guard": "off"}
    kinds = {
        "artifact_mismatch": RefusalKind(replace(mapper, manifest=manifest | {"target_fingerprint": "0" * 64}),
                                         "does not belong to this pair", at_binding=True),
        "nonfinite_map": RefusalKind(_overflowing(mapper), "is not finite", unguarded),
        "nonfinite_source": RefusalKind(mapper, "contains NaN or Inf", unguarded, poison=True),
        "beyond_length": RefusalKind(replace(mapper, manifest=manifest | {"calibration": {"seq_len": 1}}),
                                     "calibration length", {"max_length_factor": 1.0, "length_guard": "factor"}),
        "failed_guard": RefusalKind(mapper, "guard:", unguarded | {"guard_max_abs": 0.0}),
    }  # fmt: skip
    source, target = run.models["source"], run.models["target"]
    checks = {}
    for kind, (broken, reason, overrides, poison, at_binding) in kinds.items():
        route = {("source", "target"): bind(source, target, broken, *bind_args)}
        held, refused, tokens_equal, diff = [], [], [], 0.0
        for history, turn in replays:
            outputs = []
            if "routed" in run.open:  # the routed kind's engines go to this attempt
                run.open.pop("routed").close()
            policy, engines = replace(run.policy, **(overrides or {})), run.engines.get("routed")
            with warnings.catch_warnings():
                if at_binding:  # refused at binding on purpose: not a warning of the run
                    warnings.simplefilter("ignore", RouteRefusedWarning)  # any other kind refused there still warns
                attempt = Session(run.models, route, policy, engines=engines)
            run.open["routed"] = attempt
            for session in (attempt, run.session("reprefill")):
                session.append("source", history)
                if poison:
                    session.cache("source", live=True).layers[0].keys[..., -1, 0] = float("nan")
                record = session.switch_to("target", turn)
                outputs.append((record, session.generate("target", [], max_new_tokens), session.cache("target")))
            (record, tokens, cache), (_, reference, reference_cache) = outputs
            gap = cache_max_abs_diff(cache, reference_cache)  # 0 exactly when every key and value is equal
            refused.append(record.status != "applied" and reason in (record.reason or ""))
            tokens_equal.append(torch.equal(tokens, reference))
            diff = max(diff, gap)
            held.append(refused[-1] and tokens_equal[-1] and gap == 0.0)
        checks[f"rollback.{kind}"] = float(bool(held) and all(held))
        checks |= {
            f"rollback.{kind}.refused": float(all(refused)),
            f"rollback.{kind}.tokens_equal": float(all(tokens_equal)),
            f"rollback.{kind}.cache_max_abs_diff": diff,
        }
    checks["rollback_verified"] = float(all(checks[f"rollback.{kind}"] == 1.0 for kind in kinds))
    return checks
