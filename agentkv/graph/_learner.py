"""Online first-order Markov model of agent transitions (docs/design.md: the learning core)."""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass

import numpy as np

from ._entropy import predictability_of_counts, transition_entropy_ratio
from ._expired import ExpiredSession, ExpiredSessions
from ._learner_state import LearnerState
from ._lineage import LearnedTransition, Observation, SessionLineage
from ._peers import PeerCounts, PeerExport

__all__ = ["LearnerConfig", "Observation", "TransitionLearner", "transition_entropy_ratio"]

# Decayed counts are stored multiplied by a growing weight so that forgetting costs O(1)
# per observation; the matrix is rescaled when the weight gets this large.
_RESCALE_AT = 1e150


@dataclass(frozen=True, slots=True)
class LearnerConfig:
    """Parameters of a TransitionLearner.

    ``half_life`` is measured in observed dispatches: after that many newer dispatches an
    observation weighs half as much (at least 0.01: a shorter one would overflow the count
    weight, and forgets everything at every dispatch anyway). ``None`` keeps counts forever.
    """

    epsilon: float = 0.1
    half_life: float | None = None
    max_agents: int = 256
    max_sessions: int = 100_000
    session_ttl: float = 3600.0
    accuracy_window: int = 50

    def __post_init__(self) -> None:
        if not self.epsilon > 0:
            raise ValueError("epsilon must be > 0")
        if self.half_life is not None and not self.half_life >= 0.01:
            raise ValueError("half_life must be >= 0.01 dispatches or None")
        if self.max_agents < 2 or self.max_sessions < 1 or self.accuracy_window < 1:
            raise ValueError("max_agents >= 2, max_sessions >= 1 and accuracy_window >= 1 are required")
        if not self.session_ttl > 0:
            raise ValueError("session_ttl must be > 0")


class TransitionLearner:
    """Counts agent -> next-agent transitions online, per session lineage.

    Invariants: ``_counts[i, j] / _weight`` is the (decayed) number of observed i -> j
    transitions, ``_entry[j] / _weight`` the number of sessions that started at j,
    ``_ends[i] / _weight`` the number that ended (or went idle: taken back if they return) after i and
    ``_interposed[i] / _weight`` the number of i's calls found interposed (see :meth:`observe`);
    ``_best[i]`` is an argmax of row i (-1: empty row); ``_agent_seen[i]`` is the dispatch number
    of agent i's last sighting, at most ``_dispatches`` (a snapshot keeps it: ``_learner_state.py``);
    every agent index in ``_sessions`` names a live agent; ``_sessions`` is ordered by
    last activity, least recent first; ``_naming[i]`` holds exactly the live sessions whose
    lineage names slot i (as their agent, or as the previous agent of what their call taught),
    so that recycling a slot visits those alone.
    """

    def __init__(self, config: LearnerConfig | None = None, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or LearnerConfig()
        self.clock = clock
        self._decay = 1.0 if self.config.half_life is None else 2.0 ** (-1.0 / self.config.half_life)
        self._index: dict[str, int] = {}
        self._names: list[str] = []  # index -> agent; slots are recycled, never left empty
        capacity = min(8, self.config.max_agents)
        self._counts = np.zeros((capacity, capacity))
        self._entry = np.zeros(capacity)
        self._ends = np.zeros(capacity)
        self._interposed = np.zeros(capacity)
        self._agent_seen = np.zeros(capacity, dtype=np.int64)  # dispatch number of last sighting
        self._best: list[int] = []  # per row, the column of its largest count (-1: empty row)
        self._weight = 1.0
        self._sessions: OrderedDict[str, SessionLineage] = OrderedDict()
        self._naming: list[set[str]] = []  # per slot, the live sessions naming it
        self._expired = ExpiredSessions()  # idle past the TTL, in case they come back
        self._dispatches = 0
        self._predictions = 0
        self._correct = 0
        self._recent: deque[tuple[int, bool]] = deque(maxlen=self.config.accuracy_window)  # (dispatch, hit)
        self.peers = PeerCounts()
        self.version = 0  # bumped on every change that alters the transition model
        self._merges = 0  # the bumps of ``version`` that merged a peer's counts

    # -- observing -----------------------------------------------------------------

    def observe(
        self,
        agent: str,
        session: str | None = None,
        parent: str | None = None,
        *,
        step: int | None = None,
        warmup: bool = False,
        now: float | None = None,
    ) -> Observation | None:
        """Learn one dispatch of ``agent``.

        ``parent`` is the agent that ran before in this session: ``""`` marks the first
        dispatch of a session, ``None`` defers to the session's last observed agent (also when the
        session idled past ``session_ttl`` and comes back: the end counted for it is taken back).
        A request repeating the session's last (agent, step) is the same dispatch (an
        agent's tool loop sends several) and, like a warm-up, teaches nothing: None.

        Interposed calls: when ``parent`` names an agent P other than the session's current
        agent X, and X's own call was learned as P -> X, then X was called between P and this
        dispatch without taking P's place in the lineage (an AutoGen selector picking the next
        speaker). X's P -> X is taken back exactly (the weight it added, ``_best``, its accuracy
        prediction), X counts one interposed call (weighted like this dispatch's transition) and
        P -> ``agent`` is learned. Calls sharing one step are siblings (parallel branches of one
        superstep), never interposed. Every learned call ages the counts, interposed ones too.
        """
        if warmup:
            return None
        now = self.clock() if now is None else now
        self._expire_sessions(now)
        state = self._sessions.get(session) if session is not None else None
        if state is None and session is not None:
            state = self._revive(session, now, parent)
        if step is not None and state is not None and state.step == step and self._names[state.index] == agent:
            state.seen = now
            self._sessions.move_to_end(session)  # type: ignore[arg-type]
            return None
        if parent is None and state is not None:
            previous: str | None = self._names[state.index]
        else:
            previous = parent or None
        previous_index = None if previous is None else self._intern(previous)
        if previous_index is not None:
            self._agent_seen[previous_index] = self._dispatches + 1  # not the stalest while interning agent
        index = self._intern(agent)
        if previous_index is not None and self._names[previous_index] != previous:
            previous_index = None  # interning the agent recycled the parent's slot: no lineage left
        if session is not None:
            state = self._sessions.get(session)  # interning may have dropped it

        self._dispatches += 1
        self._agent_seen[index] = self._dispatches
        interposed = None
        if parent and previous_index is not None and state is not None:
            interposed = self._take_back_if_interposed(session, state, previous_index, step)  # type: ignore[arg-type]
        predicted = None
        learned = None
        self._age()
        if interposed is not None:
            self._interposed[interposed] += self._weight  # weighs like the transition it sat in
        if previous_index is None:
            self._entry[index] += self._weight
        else:
            best = self._best[previous_index]
            predicted = None if best < 0 else self._names[best]
            hit = predicted == agent
            self._predictions += 1
            self._correct += hit
            self._recent.append((self._dispatches, hit))
            learned = LearnedTransition(previous_index, self._weight, best, self._dispatches, hit)
            counts = self._counts  # element reads and writes: no row view per dispatch
            count = counts[previous_index, index] + self._weight
            counts[previous_index, index] = count
            if best < 0 or count > counts[previous_index, best]:
                self._best[previous_index] = index
        if session is not None:
            self._place(session, SessionLineage(index, now, step, learned))
        self.version += 1
        return Observation(agent, session, None if previous_index is None else previous, predicted)

    def _take_back_if_interposed(self, session: str, state: SessionLineage, parent: int,
                                 step: int | None) -> int | None:
        """Undo the current agent X's P -> X if this dispatch (parent P) shows X was interposed; X or None."""
        learned = state.learned
        if learned is None or learned.previous != parent or state.index == parent:
            return None
        if step is not None and state.step == step:
            return None  # siblings of one superstep: parallel branches, each a real transition
        interposed = state.index
        row = self._counts[parent]
        row[interposed] = max(0.0, row[interposed] - learned.weight)
        if self._best[parent] == interposed:
            best = learned.best_before
            if best < 0 or row[best] < row[: len(self._names)].max():
                self._recompute_best(parent)
            else:
                self._best[parent] = best
        self._predictions -= 1  # top-1 accuracy is about the chain of dispatches
        self._correct -= learned.hit
        with suppress(ValueError):  # unless it already left the window
            self._recent.remove((learned.prediction, learned.hit))
        self._naming[parent].discard(session)  # no longer named: parent != state.index, checked above
        state.learned = None
        return interposed

    def _place(self, session: str, state: SessionLineage) -> None:
        """Make ``state`` the session's lineage, its most recent, indexed by the slots it names."""
        self._drop(session)
        self._sessions[session] = state
        self._naming[state.index].add(session)
        if state.learned is not None:
            self._naming[state.learned.previous].add(session)
        if len(self._sessions) > self.config.max_sessions:
            self._drop(next(iter(self._sessions)))

    def _drop(self, session: str) -> SessionLineage | None:
        """Forget a live session (None if unknown), and its entries in ``_naming``."""
        state = self._sessions.pop(session, None)
        if state is not None:
            self._naming[state.index].discard(session)
            if state.learned is not None:
                self._naming[state.learned.previous].discard(session)
        return state

    def end_session(self, session: str) -> None:
        """The session ended (or was cancelled): learn that its last agent ended it. Final, also for a
        session that expired: a later dispatch of it starts a new session."""
        self._expired.pop(session)
        self._end(session)

    def _end(self, session: str) -> SessionLineage | None:
        state = self._drop(session)
        if state is not None:
            self._ends[state.index] += self._weight
            self.version += 1
        return state

    def _revive(self, session: str, now: float, parent: str | None) -> SessionLineage | None:
        """The lineage of a session that expired and came back, its end taken back (None: not remembered,
        or ``parent`` ``""`` starts it anew, so it did end). Its last call's transition stays learned:
        after so long it is not found interposed."""
        expired = self._expired.pop(session)
        if expired is None or parent == "":
            return None
        # the same stored amount the end added (rescaled with the counts); max: float rounding only
        self._ends[expired.index] = max(0.0, self._ends[expired.index] - expired.end)
        self.version += 1
        state = SessionLineage(expired.index, now, expired.step)
        self._place(session, state)
        return state

    def _age(self) -> None:
        if self._decay == 1.0:
            return
        self._weight /= self._decay
        if self._weight > _RESCALE_AT:
            self._counts /= self._weight
            self._entry /= self._weight
            self._ends /= self._weight
            self._interposed /= self._weight
            for state in self._sessions.values():
                if state.learned is not None:
                    state.learned.weight /= self._weight
            self._expired.rescale(self._weight)
            self._weight = 1.0

    def _expire_sessions(self, now: float) -> None:
        deadline = now - self.config.session_ttl
        while self._sessions:
            session, state = next(iter(self._sessions.items()))
            if state.seen >= deadline:
                break
            self._end(session)  # idle past the TTL: over, unless it comes back (``_revive``)
            self._expired.add(session, ExpiredSession(state.index, state.step, self._weight))

    def _intern(self, agent: str) -> int:
        """The slot of ``agent``; a new agent's slot is stamped as seen now, so that interning
        several (a peer's merge) recycles a different stale slot for each, not the same one."""
        index = self._index.get(agent)
        if index is not None:
            return index
        if len(self._names) < self.config.max_agents:
            if len(self._names) == self._counts.shape[0]:
                self._grow()
            index = len(self._names)
            self._names.append(agent)
            self._best.append(-1)
            self._naming.append(set())
        else:
            index = self._evict_agent()
            self._names[index] = agent
        self._index[agent] = index
        self._agent_seen[index] = self._dispatches
        return index

    def _grow(self) -> None:
        old = self._counts.shape[0]
        new = min(old * 2, self.config.max_agents)
        counts = np.zeros((new, new))
        counts[:old, :old] = self._counts
        self._counts = counts
        self._entry = np.concatenate([self._entry, np.zeros(new - old)])
        self._ends = np.concatenate([self._ends, np.zeros(new - old)])
        self._interposed = np.concatenate([self._interposed, np.zeros(new - old)])
        self._agent_seen = np.concatenate([self._agent_seen, np.zeros(new - old, dtype=np.int64)])

    def _evict_agent(self) -> int:
        """Drop the agent seen least recently and return its cleared slot."""
        index = int(np.argmin(self._agent_seen[: len(self._names)]))
        del self._index[self._names[index]]
        self._counts[index, :] = 0.0
        self._counts[:, index] = 0.0
        self._entry[index] = 0.0
        self._ends[index] = 0.0
        self._interposed[index] = 0.0
        for row, best in enumerate(self._best):
            if best == index or row == index:
                self._recompute_best(row)
        for session in list(self._naming[index]):
            state = self._sessions[session]
            if state.index == index:
                self._drop(session)
            else:
                state.learned = None  # its count was cleared with the row
        self._naming[index].clear()
        self._expired.forget_slot(index)
        return index

    def _recompute_best(self, row: int) -> None:
        counts = self._counts[row, : len(self._names)]
        best = int(np.argmax(counts)) if counts.size else -1
        self._best[row] = best if best >= 0 and counts[best] > 0 else -1

    # -- reading -------------------------------------------------------------------

    @property
    def agents(self) -> list[str]:
        """Known agents, in index order (the order of matrix rows and columns)."""
        return list(self._names)

    def _own(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        n, weight = len(self._names), self._weight
        return (
            self._counts[:n, :n] / weight,
            self._entry[:n] / weight,
            self._ends[:n] / weight,
            self._interposed[:n] / weight,
        )

    def _merged(self, part: int) -> np.ndarray:
        n = len(self._names)  # only the part asked for (``_own`` divides all four)
        parts = (self._counts[:n, :n], self._entry[:n], self._ends[:n], self._interposed[:n])
        own = parts[part] / self._weight
        if not self.peers.version:
            return own
        own_weight = sum(float(p.sum()) for p in parts) / self._weight  # the peers' bound scales with it
        return own + self.peers.aligned(self._names, own_weight)[part]

    def counts(self) -> np.ndarray:
        """Decayed transition counts among ``agents`` (row: from, column: to), peers' included."""
        return self._merged(0)

    def entry_counts(self) -> np.ndarray:
        """Decayed counts of sessions starting at each of ``agents``, peers' included."""
        return self._merged(1)

    def end_counts(self) -> np.ndarray:
        """Decayed counts of sessions that ended right after each of ``agents``, peers' included."""
        return self._merged(2)

    def interposed_counts(self) -> np.ndarray:
        """Decayed counts of each of ``agents``' calls found interposed, peers' included."""
        return self._merged(3)

    def interposed_rate(self) -> np.ndarray:
        """Per agent (``agents`` order), the expected number of its interposed calls per transition.

        An interposed call is made between two dispatches without being one (see
        :meth:`observe`): an AutoGen selector called before every speaker turn has a rate of 1.
        Zeros before any transition.
        """
        interposed = self.interposed_counts()
        transitions = self.counts().sum()
        return interposed / transitions if transitions > 0 else np.zeros_like(interposed)

    # -- replicas ------------------------------------------------------------------

    def export_counts(self, replica: str, epoch: str) -> PeerExport:
        """This learner's own counts (never what it merged from peers), for other replicas."""
        # sequenced by this replica's own changes: two replicas merging each other's exports would
        # otherwise see a new one at every pull and rebuild for ever without traffic
        return PeerExport(replica, epoch, self.own_version, *self._held())

    @property
    def own_version(self) -> int:
        """``version`` less its bumps by peers' merges: changes only with what this learner learned."""
        return self.version - self._merges

    def merge_peer(self, export: PeerExport) -> bool:
        """Take another replica's latest counts into the model; False if stale or a replay. A peer's
        agent takes a free slot only: never one of an agent this replica learned."""
        if not self.peers.merge(export):
            return False
        for agent in export.agents:
            if agent in self._index or len(self._names) < self.config.max_agents:
                self._intern(agent)
        self.version += 1
        self._merges += 1
        return True

    def transition_matrix(self) -> np.ndarray:
        """P[i, j] = (C_ij + eps) / (sum_k (C_ik + eps) + E_i), in ``agents`` order.

        E_i counts sessions that ended after agent i, so a row sums to less than 1 by
        the probability that the session ends there (without ends: the paper's formula).
        """
        counts = self.counts()
        eps = self.config.epsilon
        n = counts.shape[0]
        if n == 0:
            return counts
        ends = self.end_counts()[:, None]
        return (counts + eps) / (counts.sum(axis=1, keepdims=True) + ends + n * eps)

    def entry_distribution(self) -> np.ndarray:
        """Distribution of the first agent of a new session, smoothed like the rows of P."""
        entry = self.entry_counts()
        n = entry.shape[0]
        if n == 0:
            return entry
        eps = self.config.epsilon
        return (entry + eps) / (entry.sum() + n * eps)

    def predictability(self) -> float:
        """R = 1 - H(A_{t+1} | A_t) / H(A_{t+1}) from the observed (unsmoothed) counts."""
        return predictability_of_counts(self.counts())

    def session_agents(self) -> dict[str, str]:
        """The current (last observed) agent of every live session."""
        return {session: self._names[state.index] for session, state in self._sessions.items()}

    def current_agent(self, session: str) -> str | None:
        state = self._sessions.get(session)
        return None if state is None else self._names[state.index]

    @property
    def dispatches(self) -> int:
        return self._dispatches

    @property
    def accuracy(self) -> float | None:
        """Online top-1 accuracy over all predictions (predict first, then learn)."""
        return self._correct / self._predictions if self._predictions else None

    @property
    def recent_accuracy(self) -> float | None:
        """Online top-1 accuracy over the last ``accuracy_window`` predictions."""
        return sum(hit for _, hit in self._recent) / len(self._recent) if self._recent else None

    def state_bytes(self) -> int:
        """Bytes of learned state: the count arrays plus the agent and session tables."""
        live = len(self.agents)
        names = sum(len(name) for name in self.agents) + 8 * live
        return (live * live + 3 * live) * 8 + names + sum(len(s) + 16 for s in self._sessions)

    # -- persistence (see _snapshot.py) ---------------------------------------------

    def _held(self) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(agents, counts, entry, ends, interposed) of this learner's own, agents with counts only: a
        name only a peer brought is neither exported (it would come back from every peer as new) nor saved."""
        counts, entry, ends, interposed = self._own()
        held = counts.sum(axis=0) + counts.sum(axis=1) + entry + ends + interposed > 0
        names = tuple(name for name, kept in zip(self._names, held, strict=True) if kept)
        return names, counts[held][:, held], entry[held], ends[held], interposed[held]

    def export_state(self) -> dict[str, object]:
        """The learned state (``_learner_state.py`` lists what is kept), as plain JSON types."""
        names, counts, entry, ends, interposed = self._held()  # peers' counts are theirs to persist
        seen = self._agent_seen[[self._index[name] for name in names]]
        return LearnerState(list(names), counts, entry, ends, interposed, seen, self._dispatches, self._predictions,
                            self._correct).document()

    def import_state(self, state: dict[str, object]) -> None:
        """Replace the learned state with an ``export_state`` (an older agentkv's too; sessions are
        transient and start empty); ValueError, leaving this learner as it was, if it is not valid."""
        restored = LearnerState.parse(state, self.config.max_agents)
        n = len(restored.agents)
        fresh = TransitionLearner(self.config, clock=self.clock)
        for name in restored.agents:
            fresh._intern(name)
        fresh._counts[:n, :n] = restored.counts
        fresh._entry[:n] = restored.entry
        fresh._ends[:n] = restored.ends
        fresh._interposed[:n] = restored.interposed
        fresh._agent_seen[:n] = restored.seen  # interning stamped them all 0: the first recycled would be slot 0
        for row in range(n):
            fresh._recompute_best(row)
        fresh._dispatches, fresh._predictions = restored.dispatches, restored.predictions
        fresh._correct = restored.correct
        version = self.version + 1
        self.__dict__.update(fresh.__dict__)
        self.version = version
