"""Rollback replayed on a routed workload's own items (src/routed.py): every refusal kind, on the (history, turn) ids
the workload built, must be reported by the routed session, which then produces the greedy tokens and the target cache
of a session that never tried a transfer, bit for bit.
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from src.artifact import Mapper
from src.eval.rollback import cache_max_abs_diff
from src.routed_runs import Run
from src.runtime.routing import RouteRefusedWarning, bind
from src.runtime.session import Session


def _overflowing(mapper: Mapper) -> Mapper:
    """Finite coefficients that pass the artifact checks but overflow float32: non-finite mapped values."""
    weight = mapper.weight_v.clone()
    weight[-1] = 3e38
    return replace(mapper, weight_v=weight)


def rollback(
    run: Run, mapper: Mapper, replays: list[tuple[torch.Tensor, torch.Tensor]], max_new_tokens: int, bind_args
) -> dict[str, float]:
    """Every refusal kind on the workload's own (history, turn) ids: the routed session must report it
    (fallback_reprefill / unsupported) and then produce the greedy tokens and the target cache of a session that
    never tried a transfer, bit for bit. `rollback.<kind>` and `rollback_verified` are 1.0 when every replay holds;
    what failed is logged beside: `.at_binding` (the route refused when bound — the planted mismatch's refusal; any
    other kind refused there never reached its own check, so it does not hold), `.refused` (every replay reported the
    refusal), `.tokens_equal`, `.cache_max_abs_diff` (over replays and layers, inf when the lengths differ)."""
    manifest = mapper.manifest
    kinds = {  # kind → (mapper, policy overrides, poison the source's cache)
        "artifact_mismatch": (replace(mapper, manifest=manifest | {"target_fingerprint": "0" * 64}), {}, False),
        "nonfinite_map": (_overflowing(mapper), {}, False),
        "nonfinite_source": (mapper, {}, True),
        "beyond_length": (replace(mapper, manifest=manifest | {"calibration": {"seq_len": 1}}),
                          {"max_length_factor": 1.0, "length_guard": "factor"}, False),  # also for a mapper with evidence
        "failed_guard": (mapper, {"guard_max_abs": 0.0}, False),
    }  # fmt: skip
    source, target = run.models["source"], run.models["target"]
    checks = {}
    for kind, (broken, overrides, poison) in kinds.items():
        route = {("source", "target"): bind(source, target, broken, *bind_args)}
        at_binding = route[("source", "target")].refusal is not None  # the mismatch's only: any other tests nothing
        held, refused, tokens_equal, diff = [], [], [], 0.0
        for history, turn in replays:
            outputs = []
            if "routed" in run.open:  # the routed kind's engines go to this attempt
                run.open.pop("routed").close()
            policy, engines = replace(run.policy, **overrides), run.engines.get("routed")
            with warnings.catch_warnings():
                if kind == "artifact_mismatch":  # refused at binding on purpose: not a warning of the run
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
            refused.append(record.status != "applied")
            tokens_equal.append(torch.equal(tokens, reference))
            diff = max(diff, gap)
            held.append(refused[-1] and tokens_equal[-1] and gap == 0.0 and at_binding == (kind == "artifact_mismatch"))
        checks[f"rollback.{kind}"] = float(bool(held) and all(held))
        checks |= {
            f"rollback.{kind}.at_binding": float(at_binding),
            f"rollback.{kind}.refused": float(all(refused)),
            f"rollback.{kind}.tokens_equal": float(all(tokens_equal)),
            f"rollback.{kind}.cache_max_abs_diff": diff,
        }
    checks["rollback_verified"] = float(all(checks[f"rollback.{kind}"] == 1.0 for kind in kinds))
    return checks
