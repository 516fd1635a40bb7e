"""`kickass report`: write the measurement report, one self-contained HTML file.

    kickass report [--campaign C] [--since T] [-o FILE.html] [--json]

What it shows and how the filters apply: ``kickass_analysis.report``.
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from pathlib import Path

from kickass_core import config

DEFAULT_NAME = "kickass-report-{date}.html"


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = subparsers.add_parser(
        "report",
        help="write the measurement report (one self-contained HTML file)",
        description="Write one HTML file with every result: the fragment study (drop rate "
        "against packet size and split, by source; fragment-intolerant clients by country and "
        "network, the paper's 8.3%% beside ours), the trials (FCT against flow size, the "
        "speedup with its interval, time in Kick-Ass mode; the paper's 1.2-4x beside ours), "
        "the edge router over time and the schedule's health. Figures are inline SVG: the "
        "file needs nothing else to be read, not even a network. Reads only the v_* views.",
    )
    p.add_argument(
        "--database-url",
        help="postgresql:// URL (env KICKASS_DATABASE_URL, else database_url in the "
        "$KICKASS_CONFIG file)",
    )
    p.add_argument(
        "--campaign",
        metavar="C",
        help="only this RIPE Atlas campaign's results and measurements (volunteers, trials, "
        "router and scheduled runs have no campaign and are shown whole)",
    )
    p.add_argument(
        "--since",
        metavar="T",
        help="only what was measured since T: an ISO date or time (UTC unless it says) or a "
        "span back from now: 24h, 7d, 2w. The study's drop rates count whole UTC days (from "
        "T's day on: its rollup is per day); flows, router samples and runs from T exactly",
    )
    p.add_argument(
        "-o",
        "--output",
        metavar="FILE.html",
        help=f"where to write it (default: ./{DEFAULT_NAME.format(date='YYYYMMDD-HHMM')})",
    )
    p.add_argument(
        "--network-table",
        metavar="FILE",
        help="an ip2asn TSV file: the volunteers' country and network by address (env "
        "KICKASS_NETWORK_TABLE); without it they are 'unknown'",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print what was written (path, sections, figures and their marks, the headline "
        "numbers) as one JSON object on stdout instead of the path",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from .report import parse_since, write_report

    since = parse_since(args.since) if args.since else None
    output = Path(
        args.output or DEFAULT_NAME.format(date=datetime.now(UTC).strftime("%Y%m%d-%H%M"))
    )
    table = config.resolve(
        "network_table", args.network_table, file=config.load_file(None), section="report"
    )
    result = write_report(
        args.database_url, output, campaign=args.campaign, since=since, network_table=table
    )
    if args.json:
        print(json.dumps(result.to_json(), default=str))
    else:
        empty = [name for name, has in result.sections.items() if not has]
        if empty:
            print(f"no data yet in: {', '.join(empty)}", file=sys.stderr)
        print(result.path)
    return 0
