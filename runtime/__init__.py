"""What runs on each rank (installed as ``autopar.runtime``): collectives, schedules, executor.

The runtime never imports the planner, the passes or the CLI.
"""
