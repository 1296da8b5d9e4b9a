"""Offline planner (issue: planner).  Not built yet: this package is empty on purpose."""
