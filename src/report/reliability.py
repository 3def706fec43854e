"""The gate's reliability tables (BENCHMARKS § reliability): how often its quality verdict is wrong, from the coverage
record scripts/gate_coverage.py writes (results/gate-coverage-cpu-2026-12-06/coverage.json)."""

from __future__ import annotations

Document = tuple[str, dict]  # (path under results/, the parsed JSON)


def _pct(value: float) -> str:
    return f"{100 * value:.2f}"


def coverage(rows: list, document: Document) -> str:
    """Per n items per task: PASS at a true loss of the margin (simulated, exact in brackets) at each discordance, in
    a two-task run, PASS at 2 and 3 points, FAIL at the margin, and PASS (power) at 0 and 0.5 points; then the same for
    turns clustered in conversations."""
    _, found = document
    cells = {(c["n"], c["discordance"], c["loss_points"]): c for c in found["independent"]}
    sizes = sorted({n for n, _, _ in cells})
    shares = sorted({q for _, q, _ in cells})
    margin = found["margin_points"]
    at = lambda n, q, loss: cells[(n, q, loss)]  # noqa: E731
    by_share = " / ".join(f"{100 * q:.0f}" for q in shares)
    lines = [
        f"| items per task | PASS at a true {margin:g}-pt loss, % (exact), discordance {by_share} % "
        f"| two-task run, max % | PASS at 2 / 3 pt, max % | FAIL at {margin:g} pt, max % "
        f"| PASS at 0 pt, % ({by_share}) | PASS at 0.5 pt, % ({by_share}) |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sizes:
        margin_pass = " / ".join(
            f"{_pct(at(n, q, margin)['simulated']['PASS'])} ({_pct(at(n, q, margin)['exact']['PASS'])})" for q in shares
        )
        beyond = " / ".join(_pct(max(at(n, q, loss)["simulated"]["PASS"] for q in shares)) for loss in (2.0, 3.0))
        lines.append(
            f"| {n} | {margin_pass} | {_pct(max(at(n, q, margin)['two_task_run_pass'] for q in shares))} | {beyond} "
            f"| {_pct(max(at(n, q, margin)['simulated']['FAIL'] for q in shares))} "
            f"| {' / '.join(_pct(at(n, q, 0.0)['simulated']['PASS']) for q in shares)} "
            f"| {' / '.join(_pct(at(n, q, 0.5)['simulated']['PASS']) for q in shares)} |"
        )
    clustered = found["clustered"]
    losses = sorted({c["loss_points"] for c in clustered})
    lines += [
        "",
        f"| conversations per task (8 turns, {100 * clustered[0]['discordance']:.0f} % of turns differ) | "
        + " | ".join(f"PASS at {loss:g} pt, %" for loss in losses)
        + f" | FAIL at {margin:g} pt, % |",
        "|---|" + "---|" * (len(losses) + 1),
    ]
    for k in sorted({c["conversations"] for c in clustered}):
        row = {c["loss_points"]: c["simulated"] for c in clustered if c["conversations"] == k}
        lines.append(
            f"| {k} | " + " | ".join(_pct(row[loss]["PASS"]) for loss in losses) + f" | {_pct(row[margin]['FAIL'])} |"
        )
    return "\n".join(lines)
