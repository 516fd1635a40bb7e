"""Wide-area trials: the remote receiver (`agent.py`, `kickass-agent`) and the
trial runner (`trials/`, `kickass trials`), around the Kick-Ass transport
(`wan-agents/transport/`, Rust). What both ends share: the flow tokens
(`token.py`), the kernel-TCP flow (`tcpflow.py`) and what a trial ran on
(`environment.py`).

Pure cores (workload, schedule, spool) take seeds, time and bytes; the shells
own sockets, processes and HTTP. See ARCHITECTURE.md and wan-agents/README.md.
"""

__version__ = "0.1.0"
