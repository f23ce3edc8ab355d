"""The autopar error family.

Every error says what was expected, what was found and how to fix it. The classes are a leaf
module (nothing from autopar is imported here) so passes and the runtime can raise them.
`assert` is kept for internal invariants only.
"""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "UntraceableModelError",
    "UnsupportedOpError",
    "UnsupportedOpWarning",
    "ShardingError",
    "InfeasiblePlanError",
    "ClusterSpecError",
    "PlanMismatchError",
    "InvalidInputError",
    "ScheduleError",
    "PassError",
    "CommunicationTimeoutError",
]


class AutoparError(Exception):
    """Base class. Build with keyword parts so every message has the same three pieces."""

    def __init__(self, message: str = "", *, expected: str | None = None, found: str | None = None,
                 fix: str | None = None) -> None:
        self.summary = message
        self.expected = expected
        self.found = found
        self.fix = fix
        parts = [message] if message else []
        if expected is not None:
            parts.append(f"expected: {expected}")
        if found is not None:
            parts.append(f"found: {found}")
        if fix is not None:
            parts.append(f"fix: {fix}")
        super().__init__("\n  ".join(parts))


class UntraceableModelError(AutoparError):
    """The model could not be captured into a graph (data-dependent control flow, bad inputs)."""


class UnsupportedOpError(AutoparError):
    """An op autopar has no rule for, where falling back to a replicated form is impossible."""


class UnsupportedOpWarning(UserWarning):
    """An op with no sharding rule ran replicated; the message names the ops."""


class ShardingError(AutoparError):
    """A tensor cannot be sharded as asked (a dim not divisible by the tensor-parallel size)."""


class InfeasiblePlanError(AutoparError):
    """No plan fits the model onto the cluster, or a pinned choice is impossible."""


class ClusterSpecError(AutoparError):
    """A cluster description is malformed or self-contradictory."""


class PlanMismatchError(AutoparError):
    """A plan does not match the model, the world size or this version of autopar."""


class InvalidInputError(AutoparError):
    """Inputs given to capture, parallelize or a step do not have the expected form."""


class ScheduleError(AutoparError):
    """A pipeline schedule is malformed or deadlocks."""


class PassError(AutoparError):
    """A graph pass failed; the message names the pass and the one that ran before it."""


class CommunicationTimeoutError(AutoparError):
    """A collective or point-to-point transfer did not finish within its timeout."""
