"""Per-rank buffer manager (issue: runtime).  Not built yet: this package is empty on purpose."""
