"""The next use of each live session's history, per agent: the vectorised core of ``score_reuse``."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from ._passage import by_origin
from ._predictor import ChainModel
from ._timing import GapTable, LiveSessions

__all__ = ["SURE", "rate_after", "session_rates"]

SURE = 1.0 - 1e-9  # the largest chance of a use within the resolution (keeps log1p finite)
_GATHER_LIMIT = 3_000_000  # table entries gathered per evaluation before grouping by row (~24 MB; the crossover)


def rate_after(time: np.ndarray, resolution: float) -> np.ndarray:
    """Reuses per second of one use expected after ``time``: P(within the resolution) / resolution."""
    return -np.expm1(-resolution / time) / resolution


def _over_steps(weights: np.ndarray, table: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """out[s] = sum over k of weights[k, s] * table[rows[s], k, :], ``table`` by origin (i, K, a).

    Small: one product over table[rows] (a K x n slice gathered per session; a run of rows that
    is every start in order, the rows of a session just dispatched, is read in place). Past
    ``_GATHER_LIMIT`` entries, one product per distinct row over a broadcast view of its slice:
    the gather would copy 0.5 GiB and take most of a second at 256 agents and 10k sessions,
    while at 24 agents and 100 sessions a product per row costs 4x the gather. The same einsum
    either way, so a session's sum is the same bits whichever sessions are evaluated with it
    (at one agent einsum may sum otherwise: never grouped), and a partial evaluation
    reproduces a full one.
    """
    out = np.empty((len(rows), table.shape[2]))
    if len(table) > 1 and len(rows) * table.shape[1] * table.shape[2] > _GATHER_LIMIT:
        order = np.argsort(rows, kind="stable")
        for part in np.split(order, np.flatnonzero(np.diff(rows[order])) + 1):  # the sessions of one row each
            if len(part):  # (no sessions: one empty part)
                shared = np.broadcast_to(table[rows[part[0]]], (len(part), *table.shape[1:]))  # a view
                out[part] = np.einsum("sk,skn->sn", weights[:, part].T, shared)
        return out
    n = len(table)
    split = len(rows) - n if len(rows) >= n and np.array_equal(rows[len(rows) - n:], np.arange(n)) else len(rows)
    np.einsum("sk,skn->sn", weights[:, :split].T, table.take(rows[:split], axis=0), out=out[:split])
    if split < len(rows):
        np.einsum("sk,skn->sn", weights[:, split:].T, table, out=out[split:])
    return out


def session_rates(chain: ChainModel, gaps: GapTable, live: LiveSessions, chain_rows: list[int], *, now: float,
                  continuation: Mapping[str, float], interposed: np.ndarray | None, hazard: np.ndarray,
                  passage: np.ndarray, resolution: float, median_gap: float, ahead: np.ndarray,
                  end_floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(rate[s, a] of the next use of agent a's prefix in session s, P(a gap as long as s's idle
    time)[s]) for the sessions ``live`` (at least one), whose agents are ``chain_rows`` of the chain.

    See ``score_reuse`` for the model and the arguments.
    """
    n = len(chain.agents)
    matrix = chain.matrix
    steps = len(passage)
    known = len(live.names)
    rows = np.array(chain_rows, dtype=np.intp)
    # per agent of the chain once, then read per session
    gap_rows = np.array(list(map(gaps.row, chain.agents)), dtype=np.intp)[rows]
    going_on = np.array([continuation.get(agent, 0.0) for agent in chain.agents], dtype=float)[rows]
    idle = np.maximum(now - np.array(live.seen, dtype=float), 0.0)
    done = np.minimum(np.maximum(np.array(live.dispatches, dtype=np.intp), 1), len(hazard))
    ends = bool(hazard.any())  # False: every session runs on (no factor of 1.0 to apply)
    told = np.array(live.going_on, dtype=float)  # None (not told) reads as NaN
    tool_left, tool_time, handoff_left, handoff_time = gaps.split_at(gap_rows, idle)
    row_sums = matrix[rows].sum(axis=1)
    stays = np.minimum(np.maximum(np.minimum(row_sums, 1.0 - hazard[done - 1]), 0.0), 1.0 - end_floor)
    # P(the same dispatch sends another request, e.g. after a tool call): continuation is
    # counted among requests that had a next one, and a session ends only between dispatches
    tool = going_on * stays / np.maximum(1.0 - going_on + going_on * stays, 1e-12)
    tool = np.where(np.isnan(told), tool, told)  # given what the server read off the last answer
    # which of tool call, next dispatch and end the session is in, given its idle time
    in_tool = tool * tool_left
    in_handoff = (1.0 - tool) * stays * handoff_left
    total = in_tool + in_handoff + (1.0 - tool) * (1.0 - stays)
    some = total > 0
    in_tool = np.divide(in_tool, total, out=np.zeros_like(total), where=some)
    in_handoff = np.divide(in_handoff, total, out=np.zeros_like(total), where=some)
    tool_soon = np.maximum(tool_time, resolution)
    handoff_soon = np.maximum(handoff_time, resolution)
    after_tool = tool_soon + median_gap  # the next dispatch after a tool call comes after the agent's next request
    # (steps, sessions): the k-th next dispatch, after a hand-off or after the tool call;
    # the chain's rows lose the chance of ending, which ``stays`` accounts for
    weights = (in_handoff[None, :] * rate_after(handoff_soon[None, :] + ahead[:, None], resolution)
               + in_tool[None, :] * rate_after(after_tool[None, :] + ahead[:, None], resolution))
    if ends:  # P(the session still runs at its k-th next dispatch): it did not end after any before
        after = np.minimum(done[None, :] + np.arange(1, steps)[:, None], len(hazard)) - 1
        alive = np.ones((steps, known))
        np.cumprod(1.0 - hazard[after], axis=0, out=alive[1:])
        weights = weights * alive
    weights = weights / np.maximum(row_sums, 1e-12)[None, :]
    session_rate = _over_steps(weights, by_origin(passage), rows)
    session_rate[np.arange(known), rows] += in_tool * rate_after(tool_soon, resolution)
    if interposed is not None and len(interposed) == n:
        session_rate += (in_handoff * rate_after(handoff_soon, resolution)
                         + in_tool * rate_after(after_tool, resolution))[:, None] * interposed[None, :]
    session_rate = np.minimum(session_rate, SURE / resolution)
    # P(a gap this long | the request's kind): a told answer waits only for a hand-off
    still = tool * tool_left + (1.0 - tool) * handoff_left
    return session_rate, still
