"""Kick-Ass scheduled work: a schedule file of items (Atlas campaigns, trial
rounds, refresh, export, housekeeping) that `kickass schedule run` carries
out when due, exactly once across hosts (see ARCHITECTURE.md)."""

__version__ = "0.1.0"
