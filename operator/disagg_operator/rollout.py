"""The arithmetic of a P/D rollout and of scaling: how many pods each revision of each role should have next.
Pure; the planner turns the answer into actions.

A new revision never comes up as a whole second P/D set. Per role r, with target T (the role's size),
surge S and unavailability U (`spec.rollout.<role>`, in pods; percentages of T, surge rounded up and
unavailability down, as a Deployment does; both 0 means a surge of 1):

- **Grow the new revision** into the room the surge leaves:  new' = min(T, T + S - old).
- **Shrink the old revisions in pairs.** A pod of the old revision may go once a *ready* new pod stands in
  for it, and prefill and decode go together: the old revisions keep the fraction
      g = max over roles of  max(0, T - U - ready_new) / T
  of each role's target (rounded up), so an old revision never keeps prefills without the decodes they
  pair with (the router pairs within one revision), and the new revision's ready pairs take over as the
  old ones leave. Among several old revisions the newest keeps its pods longest.

What this guarantees at every step, with pods becoming ready in any order:
- pods of a role never exceed T + S (the new revision grows only into room the old one left);
- some revision has a ready prefill and a ready decode (the old revisions keep a full pair's fraction until
  the new revision has ready pods of *both* roles to stand in, and at least one pair whatever U allows);
- ready pods per role stay within [T - U, T + S], so with the default budgets (S = 1, U = 0) the ready P:D
  ratio is within one pod of T_p:T_d.

Scaling is the same rule with no old revision: the target moves, the revision grows or shrinks to it
(a shrink goes through retirement: the planner drains a pod before it goes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

from disagg_connector import contract

Role = str


@dataclass(frozen=True)
class Budget:
    target: int
    surge: int
    unavailable: int


def _pods(value: int | str, target: int, round_up: bool) -> int:
    if isinstance(value, int):
        return value
    share = int(value.rstrip("%")) * target / 100
    return math.ceil(share) if round_up else math.floor(share)


def budget(target: int, max_surge: int | str, max_unavailable: int | str) -> Budget:
    surge = _pods(max_surge, target, round_up=True)
    unavailable = min(_pods(max_unavailable, target, round_up=False), target)
    if surge == 0 and unavailable == 0:
        surge = 1  # a rollout must be able to move
    return Budget(target, surge, unavailable)


@dataclass(frozen=True)
class Count:
    """One revision's pods of one role: how many it is meant to have, how many are ready."""

    desired: int
    ready: int


@dataclass(frozen=True)
class Step:
    new: Mapping[Role, int]  # desired pods of the current revision per role
    old: Mapping[str, Mapping[Role, int]]  # desired pods per old revision per role

    def done(self, budgets: Mapping[Role, Budget]) -> bool:
        return all(n == budgets[r].target for r, n in self.new.items()) and not any(
            any(v for v in roles.values()) for roles in self.old.values())


def next_step(
    budgets: Mapping[Role, Budget],
    new: Mapping[Role, Count],
    old: Mapping[str, Mapping[Role, Count]],
    old_order: tuple[str, ...],
) -> Step:
    """The next desired sizes. `old_order`: old revisions, newest first (it keeps its pods longest)."""
    roles = tuple(contract.ENGINE_ROLES)
    old_desired = {r: sum(old[v][r].desired for v in old) for r in roles}
    grown = {r: min(budgets[r].target, max(new[r].desired, budgets[r].target + budgets[r].surge - old_desired[r]))
             for r in roles}

    # The fraction of each role's target the old revisions still keep (the larger one binds both roles).
    keep_fraction = max(
        (max(0, b.target - b.unavailable - new[r].ready) / b.target if b.target else 0.0)
        for r, b in budgets.items()
    )
    # Whatever the unavailability allows, the old revisions keep a pair until the new one has a ready pair.
    pair_floor = 0 if all(new[r].ready for r in roles) else 1
    kept: dict[str, dict[Role, int]] = {v: {} for v in old}
    for r in roles:
        left = min(old_desired[r], max(pair_floor, math.ceil(keep_fraction * budgets[r].target)))
        for revision in old_order:
            have = old[revision][r].desired
            kept[revision][r] = min(have, left)
            left -= kept[revision][r]
    return Step(new=grown, old=kept)
