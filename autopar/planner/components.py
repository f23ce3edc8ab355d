"""The pieces the cost model borrows from other parts of autopar, in one place.

Three of them are STAND-INS until their issues land; plugging the real one in is changing
:func:`default_components` (or passing a ``Components`` to the search):

============================  ======================================  ==============================
piece                         stand-in (here)                         real one (when it lands)
============================  ======================================  ==============================
tensor-parallel sharding      ``MegatronPatternSharding``             ``passes/shard.py``
stage partition               ``MinMaxContiguousSplit``               ``planner/stage_partition.py``
schedule step time (search)   ``ClosedFormScheduleModel``             ``runtime/simulator.py``
schedule timeline (simulate)  ``EventPipelineSimulator``              ``runtime/simulator.py``
============================  ======================================  ==============================
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.planner.schedule_model import (ClosedFormScheduleModel, EventPipelineSimulator,
                                            ScheduleModel)
from autopar.planner.stage_split import MinMaxContiguousSplit, StagePartitioner
from autopar.planner.tp_pattern import MegatronPatternSharding

__all__ = ["Components", "default_components"]


@dataclass(frozen=True)
class Components:
    sharding: MegatronPatternSharding = field(default_factory=MegatronPatternSharding)
    partitioner: StagePartitioner = field(default_factory=MinMaxContiguousSplit)
    #: Prices every candidate of the search (must be fast).
    schedule_model: ScheduleModel = field(default_factory=ClosedFormScheduleModel)
    #: Produces the timeline of `autopar simulate` and re-prices the search's finalists.
    simulator: EventPipelineSimulator = field(default_factory=EventPipelineSimulator)

    def describe(self) -> dict[str, str]:
        return {"sharding": self.sharding.name, "partitioner": self.partitioner.name,
                "schedule_model": self.schedule_model.name, "simulator": self.simulator.name}


def default_components() -> Components:
    return Components()
