"""Kick-Ass analysis: the statistics every view of the results shares, the
rollups the scheduled ``refresh`` computes, `kickass report`, `kickass export`
and the volunteer's page (see ARCHITECTURE.md)."""

__version__ = "0.1.0"
