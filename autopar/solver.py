"""The integer-programming backend behind pulp: HiGHS in process, CBC as the fallback.

autopar states its programs with pulp (the sharding ILP of ``passes/shard.py``, the stage ILP of
``planner/stage_partition.py``) and solves them here. HiGHS (Huangfu and Hall 2018; the MIP
solver of Galabova and Hall) runs in the process through ``highspy``, with no subprocess and no
files per solve, and closes the stage ILP's optimality gap where CBC stalls: on GPT-3 175B's ZB-V
and interleaved finalists CBC stopped at a 5 s limit with cuts 9-28% worse than the optimum
HiGHS proves in 0.08-2 s (docs/cost-model.md, "Search"). CBC (``PULP_CBC_CMD``, shipped with
pulp) is used when ``highspy`` cannot be imported, with the same statuses.

:func:`solve` returns what the callers need to know: whether the answer is proven optimal, a
feasible point found before the time limit, infeasible, or nothing at all.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import pulp

__all__ = ["SolveResult", "solve", "backend"]


@dataclass(frozen=True, slots=True)
class SolveResult:
    #: "optimal" (gap closed), "feasible" (stopped at the time limit with a point),
    #: "infeasible", or "none" (stopped with no point).
    status: str
    seconds: float
    backend: str

    @property
    def has_solution(self) -> bool:
        return self.status in ("optimal", "feasible")


_HIGHS: Any = None
#: The first :func:`backend` call swaps file descriptor 1, which the whole process shares: two
#: threads doing it at once could each save the other's /dev/null and leave stdout silenced.
_HIGHS_LOCK = threading.Lock()


@contextlib.contextmanager
def _stdout_silenced() -> Iterator[None]:
    """File descriptor 1 to /dev/null: HiGHS prints its banner from C++ when the first
    instance of the process is made, before any option can turn output off."""
    try:
        saved = os.dup(1)
    except OSError:  # no stdout to protect
        yield
        return
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def backend() -> str:
    """``"highs"`` when highspy can be imported, else ``"cbc"``."""
    global _HIGHS
    with _HIGHS_LOCK:
        if _HIGHS is None:
            try:
                import highspy

                with _stdout_silenced():
                    highspy.Highs()  # the banner, once
                _HIGHS = True
            except ImportError:
                _HIGHS = False
    return "highs" if _HIGHS else "cbc"


def _highs_with_start(start: Mapping[Any, float], **options: Any) -> Any:
    """pulp's HiGHS interface, handing HiGHS a starting point (``setSolution``; HiGHS completes
    a partial one) once the model is built and before it runs."""

    class _WithStart(pulp.HiGHS):  # type: ignore[misc, valid-type]
        def callSolver(self, lp: Any) -> None:
            import numpy as np

            index = np.array([var.index for var in start], dtype=np.int32)
            values = np.array([float(v) for v in start.values()], dtype=np.float64)
            lp.solverModel.setSolution(len(index), index, values)
            super().callSolver(lp)

    return _WithStart(**options)


def solve(prob: pulp.LpProblem, *, time_limit_s: float, gap_rel: float = 0.0,
          mip: bool = True, threads: int = 1,
          start: Mapping[Any, float] | None = None) -> SolveResult:
    """Solve ``prob`` in place (its variables hold the answer) and say what the answer is.

    ``gap_rel=0`` asks for a proven optimum; ``mip=False`` solves the LP relaxation;
    ``start`` (variable -> value, possibly partial) is a feasible point to begin from (HiGHS
    only): an incumbent at or near the optimum lets branch and bound prune from the first node,
    the proof of optimality is unchanged."""
    name = backend()
    begin = time.perf_counter()
    if name == "highs":
        options = dict(msg=False, mip=mip, timeLimit=time_limit_s, gapRel=gap_rel,
                       threads=threads)
        solver = _highs_with_start(start, **options) if start else pulp.HiGHS(**options)
        prob.solve(solver)
        model = prob.solverModel
        import highspy

        status = model.getModelStatus()
        has_point = (int(model.getInfo().primal_solution_status)
                     == int(highspy.SolutionStatus.kSolutionStatusFeasible))
        if status == highspy.HighsModelStatus.kOptimal:
            out = "optimal"
        elif status in (highspy.HighsModelStatus.kInfeasible,
                        highspy.HighsModelStatus.kUnboundedOrInfeasible):
            out = "infeasible"
        else:
            out = "feasible" if has_point else "none"
    else:
        solver = pulp.PULP_CBC_CMD(msg=False, mip=mip, timeLimit=time_limit_s,
                                   gapRel=gap_rel, gapAbs=0.0 if gap_rel == 0.0 else None,
                                   threads=threads)
        prob.solve(solver)
        if prob.status == pulp.LpStatusInfeasible:
            out = "infeasible"
        elif prob.sol_status == pulp.LpSolutionOptimal:
            out = "optimal"
        elif prob.sol_status == pulp.LpSolutionIntegerFeasible:
            out = "feasible"
        else:
            out = "none"
    return SolveResult(out, time.perf_counter() - begin, name)
