"""The autopar error family.

Every error says what was expected, what was found and how to fix it. The classes are a leaf
module (nothing from autopar is imported here) so passes and the runtime can raise them.
`assert` is kept for internal invariants only.
"""

from __future__ import annotations

__all__ = [
    "AutoparError",
    "UntraceableModelError",
    "UnsupportedMoEError",
    "UnsupportedOpError",
    "UnsupportedOpWarning",
    "ShardingError",
    "InfeasiblePlanError",
    "ClusterSpecError",
    "PlanMismatchError",
    "InvalidInputError",
    "InvalidPlanError",
    "ScheduleError",
    "PassError",
    "CommunicationTimeoutError",
    "VerificationError",
    "OffloadError",
    "CheckpointError",
    "StageExecutionError",
    "error_parts",
    "error_from_parts",
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


class UnsupportedMoEError(UntraceableModelError):
    """A mixture-of-experts block autopar cannot capture as its experts operation."""


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


class InvalidPlanError(InvalidInputError, ValueError):
    """A plan, or the pins of one, is malformed or self-contradictory (``zero=7``, an unknown
    schedule, virtual stages without the interleaved schedule). Also a ``ValueError``: the plan's
    dataclasses validate themselves as STYLE.md asks."""


class ScheduleError(AutoparError):
    """A pipeline schedule is malformed or deadlocks."""


class PassError(AutoparError):
    """A graph pass failed; the message names the pass and the one that ran before it."""


class CommunicationTimeoutError(AutoparError):
    """A collective or point-to-point transfer did not finish within its timeout."""


class VerificationError(AutoparError):
    """The parallel program's activations or loss differ from the original model's beyond the
    tolerance (``parallelize(..., verify=True)`` / ``ParallelModel.verify``). ``report`` holds the
    per-layer differences; the message names the first layer that differs."""

    def __init__(self, message: str = "", *, report: object = None, **parts: str | None) -> None:
        super().__init__(message, **parts)
        self.report = report


class OffloadError(AutoparError):
    """Offloaded optimizer state cannot be kept where the plan puts it: the offload directory
    is missing, not writable, or full (``Plan.offload = "disk"``)."""


class CheckpointError(AutoparError):
    """A checkpoint cannot be written where it is asked for (``ParallelModel.save``,
    ``save_pretrained``): the path is a file, under a directory that cannot be created or
    written, or the disk filled up while writing. Nothing half-written is left as a checkpoint
    (a save marks itself complete last; ``save_pretrained`` renames its directory into place
    at the end)."""

    @classmethod
    def unwritable(cls, path: object, exc: BaseException, what: str = "a checkpoint"
                   ) -> "CheckpointError":
        """The named error for ``exc`` (an ``OSError``) met writing ``what`` at ``path``."""
        reason = getattr(exc, "strerror", None) or str(exc)
        return cls(f"cannot write {what} at {path}",
                   expected="a directory this process can create and write, with room for it",
                   found=f"{type(exc).__name__}: {reason}",
                   fix="give a writable directory (not an existing file, not under a read-only "
                       "mount) on a disk with room for the checkpoint")


class StageExecutionError(AutoparError):
    """A rank's generated program failed inside a stage (a forward, backward or weight-gradient
    action): an op of the captured graph that does not run under the plan's placements, which is
    a fault of autopar's transform rather than of the model. The message names the action, the
    line of the generated program where it failed (``ParallelModel.generated_code``) and torch's
    error; ``__cause__`` holds that error."""


def error_parts(exc: BaseException) -> dict[str, str | None]:
    """What it takes to raise ``exc`` again on another rank (:func:`error_from_parts`)."""
    if isinstance(exc, AutoparError):
        return {"class_name": type(exc).__name__, "summary": exc.summary,
                "expected": exc.expected, "found": exc.found, "fix": exc.fix}
    return {"class_name": type(exc).__name__, "summary": str(exc)}


def error_from_parts(class_name: str, summary: str, expected: str | None = None,
                     found: str | None = None, fix: str | None = None) -> Exception:
    """Rebuild an error raised on another rank: the same class (an autopar error or a Python
    built-in exception) with the same message. Unknown classes become an AutoparError naming them.
    """
    import builtins

    cls = globals().get(class_name)
    if isinstance(cls, type) and issubclass(cls, AutoparError):
        return cls(summary, expected=expected, found=found, fix=fix)
    text = "\n  ".join([summary] + [f"{k}: {v}" for k, v in
                                     (("expected", expected), ("found", found), ("fix", fix))
                                     if v is not None])
    cls = getattr(builtins, class_name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except TypeError:  # built-ins with other constructor signatures
            pass
    return AutoparError(f"{class_name}: {text}")
