"""Beside the method: the eviction policies it is measured against (baselines) and held-out scoring
(scoring), which train.py, scripts/eval.py and scripts/reproduce.py call."""
