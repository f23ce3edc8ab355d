"""autopar: a compiler that auto-parallelizes PyTorch models.

The data flow: :func:`capture` (torch.export) -> analysis -> plan -> passes -> per-rank code ->
runtime. This module is a thin face over it; import costs stay in the submodules.
"""

from autopar.api import parallelize
from autopar.cluster import Cluster
from autopar.frontend import CapturedGraph, capture
from autopar.parallel_model import ParallelModel
from autopar.plan import Plan, Prediction
from autopar.errors import (
    AutoparError,
    ClusterSpecError,
    InfeasiblePlanError,
    InvalidInputError,
    PlanMismatchError,
    ShardingError,
    UnsupportedOpError,
    UnsupportedOpWarning,
    UntraceableModelError,
)

__version__ = "0.1.0"

__all__ = [
    "parallelize",
    "ParallelModel",
    "Plan",
    "Prediction",
    "capture",
    "CapturedGraph",
    "Cluster",
    "AutoparError",
    "ClusterSpecError",
    "InfeasiblePlanError",
    "InvalidInputError",
    "PlanMismatchError",
    "ShardingError",
    "UnsupportedOpError",
    "UnsupportedOpWarning",
    "UntraceableModelError",
    "__version__",
]
