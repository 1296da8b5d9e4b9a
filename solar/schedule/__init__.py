"""Schedule files: what the planner decided, stored so each rank reads only its slice.

``solar.plan(...)`` plans a job and writes the file; ``Schedule.load(path)`` opens one.
The format is described in :mod:`solar.schedule.format`.
"""
from .make import buffer_bytes, plan
from .schedule import NodeRankPlan, RankPlan, Schedule, ScheduleError, StepPlan

__all__ = ["plan", "buffer_bytes", "Schedule", "RankPlan", "NodeRankPlan", "StepPlan", "ScheduleError"]
