"""Tests of the PPO-actor example (run with examples/ on sys.path; see conftest.py)."""
