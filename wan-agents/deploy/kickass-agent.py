#!/usr/bin/python3.11 -IS
# kickass-agent as the Debian package installs it (wan-agents/deploy/build-deb.sh):
# Debian's Python 3.11 with nothing of the host's site-packages (-S) or
# environment (-I); the agent and its dependencies come from the package.
import sys

sys.path[:0] = ["/opt/kickass-agent/lib/python"]
from kickass_wan.agent import main  # noqa: E402

sys.exit(main())
