"""Wide-area trials: the remote receiver (`kickass-agent`) and the trial runner
(`kickass trials`), around the Kick-Ass transport (`ka-transport`, Rust).

Pure cores (workload, schedule, spool) take seeds, time and bytes; the shells
own sockets, processes and HTTP. See ARCHITECTURE.md and wan-agents/README.md.
"""

__version__ = "0.1.0"
