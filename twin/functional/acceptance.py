"""The acceptance golden measures, as the vector the cost model's acceptance model consumes.

golden counts, per draft position j, the speculative verifies in which draft j was accepted
(`acceptance_per_position`, unconditional, as upstream's `dspark_speculation_summary`).  The cost
model's `ConditionalAcceptance` wants a_j = P(draft j accepted | drafts < j accepted), so
a_j = u_j / u_{j-1} (u_0 = 1); a position never reached gets 0.  The JSON carries both, and
`load_acceptance` turns the file back into the model (`dspark-twin simulate --acceptance-from`).
"""
from __future__ import annotations

from pathlib import Path

from twin.abi import constants as C
from twin.abi.errors import ConfigError
from twin.abi.inputs import number, read_json
from twin.sim.acceptance import ConditionalAcceptance


def conditional_rates(unconditional) -> list[float]:
    u = [1.0] + [float(x) for x in unconditional]
    return [u[j] / u[j - 1] if u[j - 1] > 0 else 0.0 for j in range(1, len(u))]


def acceptance_vector(summary: dict) -> dict:
    """From golden's speculation summary to the exported record."""
    u = list(summary["acceptance_per_position"])
    return {"kind": "conditional", "source": "golden", "rates": conditional_rates(u), "unconditional": u,
            "verify_steps": summary["verify_steps"], "fallback_steps": summary["fallback_steps"],
            "mean_accepted_length": summary["mean_accepted_length"]}


def load_acceptance(path: str | Path, flag: str = "--acceptance-from") -> ConditionalAcceptance:
    n = C.DSPARK_QUERY_WIDTH
    what = f"an acceptance.json of a golden run: {{\"rates\": [{n} conditional probabilities], ...}}"
    d = read_json(path, flag, what)
    rates = d.get("rates")
    if not isinstance(rates, list) or len(rates) != n:
        raise ConfigError("rates", rates, f"a list of {n} probabilities in [0, 1]", where=f"{flag} {path}")
    return ConditionalAcceptance(tuple(number(x, f"rates[{j}]", f"{flag} {path}", lo=0.0, hi=1.0)
                                       for j, x in enumerate(rates)))
