"""The third-party requirements of the workspace packages an image installs.

    python docker/requirements.py core/pyproject.toml db/pyproject.toml ... > requirements.txt

Prints every dependency and build requirement of the named pyproject.toml
files, except the workspace's own packages (kickass-*), one per line, sorted.
The server image installs these in a layer of their own, before it copies
the sources: a source edit then rebuilds only the small layer that installs
the workspace packages, not numpy, scapy and the rest (docker/server.Dockerfile).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

OWN = re.compile(r"^kickass[-_]", re.IGNORECASE)


def requirements(paths: list[Path]) -> list[str]:
    found: set[str] = set()
    for path in paths:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        project = data.get("project", {})
        wanted = [
            *project.get("dependencies", []),
            *data.get("build-system", {}).get("requires", []),
        ]
        found.update(r.strip() for r in wanted if not OWN.match(r.strip()))
    return sorted(found, key=str.lower)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: requirements.py PYPROJECT.toml...", file=sys.stderr)
        return 2
    for line in requirements([Path(a) for a in argv]):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
