"""autopar: a compiler that auto-parallelizes PyTorch models.

The data flow: :func:`capture` (torch.export) -> analysis -> plan -> passes -> per-rank code ->
runtime. This module is a thin face over it: :func:`parallelize` (on every rank of a job) and
:func:`plan` (no process group: what the planner would choose, and why).
"""

from autopar._version import __version__
from autopar.api import parallelize
from autopar.cluster import Cluster
from autopar.frontend import CapturedGraph, capture, plan_fingerprint
from autopar.models.workload import Workload
from autopar.parallel_model import ParallelModel
from autopar.plan_types import OptimizerProfile, OptimizerStep, Plan, Prediction
from autopar.planner.planning import PlanReport, plan
from autopar.errors import (
    AutoparError,
    CheckpointError,
    ClusterSpecError,
    CommunicationTimeoutError,
    InfeasiblePlanError,
    InvalidInputError,
    InvalidPlanError,
    OffloadError,
    PlanMismatchError,
    ShardingError,
    StageExecutionError,
    UnsupportedMoEError,
    UnsupportedOpError,
    UnsupportedOpWarning,
    UntraceableModelError,
    VerificationError,
)

__all__ = [
    "parallelize",
    "plan",
    "PlanReport",
    "Workload",
    "ParallelModel",
    "Plan",
    "OptimizerProfile",
    "OptimizerStep",
    "Prediction",
    "capture",
    "CapturedGraph",
    "plan_fingerprint",
    "Cluster",
    "AutoparError",
    "CheckpointError",
    "ClusterSpecError",
    "CommunicationTimeoutError",
    "InfeasiblePlanError",
    "InvalidInputError",
    "InvalidPlanError",
    "OffloadError",
    "StageExecutionError",
    "PlanMismatchError",
    "ShardingError",
    "UnsupportedMoEError",
    "UnsupportedOpError",
    "UnsupportedOpWarning",
    "UntraceableModelError",
    "VerificationError",
    "__version__",
]
