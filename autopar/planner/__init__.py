"""Planner: cost model, plan search, stage partition ILP."""
