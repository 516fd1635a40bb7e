"""Shared core of the Kick-Ass measurement platform.

Dependency-free on purpose: the volunteer client installs it, so it must stay
a few kilobytes of pure Python. Wire formats, the paper's rate and RTT
encodings and the probe plan live here once; server, client and agents import
them, and the JSON vectors in ``core/vectors`` pin the bytes for the Rust side.
"""

__version__ = "0.1.0"
