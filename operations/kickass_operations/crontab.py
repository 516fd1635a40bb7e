"""``kickass schedule crontab``: the line that runs the schedule every minute
(the database decides what is due), for cron or as a systemd timer.

The line names absolute paths only: cron runs it with ``/bin/sh -c``, a
``PATH`` of ``/usr/bin:/bin``, no virtual environment and ``HOME`` alone.
Secrets never go in it: the database URL (or the runner token file) comes
from the configuration file named by ``KICKASS_CONFIG`` or from the
schedule file itself. Lines are written between two marker comments, so
``--install`` replaces its own lines and leaves everything else alone.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

from kickass_core.errors import KickassError

BEGIN = "# BEGIN kickass schedule {name} (kickass schedule crontab --install)"
END = "# END kickass schedule {name}"


def command(
    schedule_path: Path,
    *,
    log_file: Path | None,
    config: Path | None,
    kickass: Path | None = None,
) -> str:
    """The shell command the cron line and the timer both run."""
    exe = kickass or Path(sys.executable).with_name("kickass")
    parts = [str(exe), "schedule", "run", str(schedule_path.resolve())]
    if log_file is not None:
        parts += ["--log-file", str(log_file.resolve())]
    cmd = " ".join(shlex.quote(p) for p in parts)
    if config is not None:
        cmd = f"KICKASS_CONFIG={shlex.quote(str(config.resolve()))} {cmd}"
    return cmd


def cron_lines(name: str, cmd: str) -> list[str]:
    # cron treats % as a newline: the command must not carry one unescaped.
    return [BEGIN.format(name=name), "* * * * * " + cmd.replace("%", r"\%"), END.format(name=name)]


def merged(existing: str, name: str, lines: list[str]) -> str:
    """``existing`` crontab text with this schedule's block replaced (or added)."""
    begin, end = BEGIN.format(name=name), END.format(name=name)
    out: list[str] = []
    skipping = False
    for line in existing.splitlines():
        if line == begin:
            skipping = True
            continue
        if skipping:
            if line == end:
                skipping = False
            continue
        out.append(line)
    while out and not out[-1].strip():
        out.pop()
    if out:
        out.append("")
    return "\n".join(out + lines) + "\n"


def install(name: str, lines: list[str], user: str | None = None) -> str:
    """Write the block into the crontab of ``user`` (default: the current one).
    Returns the crontab as installed."""
    base = ["crontab"] + (["-u", user] if user else [])
    try:
        cur = subprocess.run(base + ["-l"], capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        raise KickassError(
            "crontab is not installed on this host",
            hint="install cron (Debian: apt-get install cron), or use --systemd, "
            "or `kickass schedule run --loop` in a container",
        ) from None
    # "no crontab for USER" is exit 1 with an empty listing: start afresh.
    existing = cur.stdout if cur.returncode == 0 else ""
    if cur.returncode != 0 and "no crontab" not in cur.stderr:
        raise KickassError(f"crontab -l failed: {cur.stderr.strip()}")
    text = merged(existing, name, lines)
    res = subprocess.run(base + ["-"], input=text, capture_output=True, text=True, timeout=30)
    if res.returncode != 0:
        raise KickassError(f"crontab refused the new table: {res.stderr.strip()}")
    return text


def systemd_units(name: str, cmd: str, *, working_dir: Path) -> dict[str, str]:
    """A oneshot service and the timer that starts it every minute."""
    unit = f"kickass-schedule-{name}"
    service = (
        "[Unit]\n"
        f"Description=Kick-Ass scheduled work ({name}): what is due, once across hosts\n"
        "After=network-online.target\n"
        "Wants=network-online.target\n\n"
        "[Service]\n"
        "Type=oneshot\n"
        f"WorkingDirectory={working_dir.resolve()}\n"
        f"ExecStart=/bin/sh -c {shlex.quote(cmd)}\n"
        # 1: an item failed (in the log and in item_runs), not the unit.
        "SuccessExitStatus=1\n"
    )
    timer = (
        "[Unit]\n"
        f"Description=Run {unit}.service every minute\n\n"
        "[Timer]\n"
        "OnCalendar=*-*-* *:*:00\n"
        "AccuracySec=1s\n"
        "Persistent=true\n"
        f"Unit={unit}.service\n\n"
        "[Install]\n"
        "WantedBy=timers.target\n"
    )
    return {f"{unit}.service": service, f"{unit}.timer": timer}


def install_units(units: dict[str, str], directory: Path) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    out = []
    for fname, text in units.items():
        p = directory / fname
        tmp = p.with_suffix(p.suffix + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, p)
        out.append(p)
    return out
