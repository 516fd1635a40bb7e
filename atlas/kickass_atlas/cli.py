"""`kickass atlas`: the fragment viability study from RIPE Atlas probes.

    kickass atlas plan CAMPAIGN.yaml        what would be created, its credit cost (no key)
    kickass atlas create CAMPAIGN.yaml      create the measurements (Cousteau)
    kickass atlas fetch CAMPAIGN.yaml       pull new results, join them to the reply log, store
    kickass atlas import CAMPAIGN.yaml FILE store result files (API JSON, NDJSON, archive dumps)
    kickass atlas status CAMPAIGN.yaml      measurements, Atlas status, results, credits spent
    kickass atlas responder CAMPAIGN.yaml   the ICMP responder the probes ping (root)

The responder is a subcommand here rather than a mode of `kickass server`:
it is driven by the campaign file (addresses, split sweep, rate caps), needs
privileges the HTTP server does not (raw sockets, nftables), and runs for as
long as the campaign's measurements do, independent of the volunteers' API.

Settings: flag > KICKASS_* environment > the [atlas] table of the
$KICKASS_CONFIG file. The API key comes only from $KICKASS_ATLAS_KEY or from
a key file (--key-file, $KICKASS_ATLAS_KEY_FILE): never a flag, which would
show in `ps` and shell history; it is never printed, logged or stored.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

from kickass_core.cli import group
from kickass_core.errors import KickassError

from . import service
from .campaign import Campaign, Plan
from .client import DEFAULT_SERVER
from .ingest.fetch import DEFAULT_CHUNK_S, DEFAULT_LATE_HORIZON_S, DEFAULT_SETTLE_S, FetchReport
from .service import DEFAULT_START_IN_S, AtlasSettings

# `kickass atlas import`: the exit status when a line was skipped, and how
# many of them the text summary names.
EXIT_SKIPPED = 1
SHOWN_SKIPPED = 20

if TYPE_CHECKING:
    from kickass_db.writer import OrderedWriter

    from .responder_core import ReplyRecord
    from .store import AtlasStore

log = logging.getLogger("kickass.atlas")
SECTION = "atlas"


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    cmds = group(
        sub,
        "atlas",
        help="RIPE Atlas campaigns for the fragment viability study",
        description="Run the fragment viability study from RIPE Atlas probes: plan and create "
        "the ping measurements, run the ICMP responder they ping, fetch and store their "
        "results beside the volunteers'. See atlas/README.md.",
    )
    _add_plan(cmds)
    _add_create(cmds)
    _add_fetch(cmds)
    _add_import(cmds)
    _add_status(cmds)
    _add_responder(cmds)


# -- the subcommands' arguments -------------------------------------------------------


def _campaign_arg(p: argparse.ArgumentParser, optional: bool = False) -> None:
    p.add_argument(
        "campaign",
        nargs="?" if optional else None,
        type=Path,
        help="the campaign YAML file (see example-campaign.yaml)",
    )


def _atlas_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--atlas-server",
        help=f"RIPE Atlas API host[:port] (default {DEFAULT_SERVER}; $KICKASS_ATLAS_SERVER)",
    )
    p.add_argument(
        "--key-file",
        type=Path,
        help="file holding the API key ($KICKASS_ATLAS_KEY_FILE; or the key itself in "
        "$KICKASS_ATLAS_KEY)",
    )
    p.add_argument(
        "--ca-bundle",
        help="CA bundle to verify the API's certificate with ($KICKASS_ATLAS_CA_BUNDLE; "
        "default: the system's)",
    )


def _db_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--database-url", help="PostgreSQL URL ($KICKASS_DATABASE_URL)")


def _json_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="machine-readable output on stdout")


def _add_plan(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cmds.add_parser("plan", help="print the measurements and their credit cost (dry run)")
    _campaign_arg(p)
    p.add_argument("--all-sizes", action="store_true", help="every whole size, not a sample")
    _json_option(p)
    p.set_defaults(func=cmd_plan)


def _add_create(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cmds.add_parser(
        "create",
        help="create the campaign's measurements on RIPE Atlas",
        description="Create the campaign's missing measurements in one request (they share "
        "their probes). Measurements an earlier run created without hearing back are found by "
        "the campaign's tag and adopted, never created twice. They start --start-in seconds "
        "later: before that, RIPE Atlas's own credits_per_result is read back and, above the "
        "campaign's credit_budget, they are stopped before costing anything.",
    )
    _campaign_arg(p)
    p.add_argument("--all-sizes", action="store_true", help="every whole size, not a sample")
    p.add_argument("--dry-run", action="store_true", help="only print the plan (= plan)")
    p.add_argument(
        "--start-in",
        type=int,
        default=DEFAULT_START_IN_S,
        metavar="SECONDS",
        help=f"start the measurements this long after creating them (default "
        f"{DEFAULT_START_IN_S}; the price check happens in between)",
    )
    _atlas_options(p)
    _db_option(p)
    _json_option(p)
    p.set_defaults(func=cmd_create)


def _add_fetch(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cmds.add_parser("fetch", help="fetch new results, join them to the reply log, store")
    _campaign_arg(p)
    p.add_argument(
        "--settle",
        type=float,
        default=DEFAULT_SETTLE_S,
        help=f"fetch results only this many seconds old or older (default {DEFAULT_SETTLE_S:g}: "
        "probes upload late)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=DEFAULT_CHUNK_S,
        help=f"seconds of results per request and commit (default {DEFAULT_CHUNK_S})",
    )
    p.add_argument(
        "--late-horizon",
        type=float,
        default=DEFAULT_LATE_HORIZON_S,
        metavar="SECONDS",
        help=f"read every window once more when it is this old, for results probes "
        f"uploaded late (default {DEFAULT_LATE_HORIZON_S:g}; later uploads are not fetched)",
    )
    _atlas_options(p)
    _db_option(p)
    _json_option(p)
    p.set_defaults(func=cmd_fetch)


def _add_import(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cmds.add_parser(
        "import",
        help="store Atlas result files as fetch would (no API needed)",
        description="Store RIPE Atlas ping results of the campaign's measurements from files: "
        "the results API's JSON list, one JSON result per line (the API's format=txt), or "
        "RIPE Atlas's hourly archive dumps (every public measurement's results, one per "
        "line, bzip2); plain or bzip2/gzip/xz-compressed. Lines of other measurements are "
        "ignored. Parsed, joined to the reply log and stored exactly as fetch does; "
        "importing the same lines again adds nothing. A line that is not JSON, or whose "
        "values its columns cannot hold (kickass_core.bounds), is skipped and named with its "
        f"line number; the rest is stored. Exit status {EXIT_SKIPPED} when a line was skipped.",
    )
    _campaign_arg(p)
    p.add_argument("files", nargs="+", metavar="FILE", help="result file, or - for stdin")
    _db_option(p)
    _json_option(p)
    p.set_defaults(func=cmd_import)


def _add_status(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cmds.add_parser("status", help="measurements, Atlas status, results, credits spent")
    _campaign_arg(p)
    p.add_argument("--offline", action="store_true", help="from the database only")
    _atlas_options(p)
    _db_option(p)
    _json_option(p)
    p.set_defaults(func=cmd_status)


def _add_responder(cmds: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = cmds.add_parser(
        "responder",
        help="run the ICMP responder the campaign's probes ping (root)",
        description="Answer the campaign's echo requests from a raw socket: whole sizes "
        "unfragmented, 1500-byte requests on the split address cut at the split sweep's "
        "leading-fragment lengths; log every reply in PostgreSQL. The kernel's own echo "
        "replies are switched off for the campaign's addresses while it runs (an nftables "
        "table, deleted on exit).",
    )
    _campaign_arg(p, optional=True)
    _db_option(p)
    p.add_argument(
        "--no-database", action="store_true", help="do not log replies (a dry run of the sockets)"
    )
    p.add_argument(
        "--undo",
        action="store_true",
        help="only give the kernel its echo replies back (after a responder was killed)",
    )
    p.add_argument("--log-level", default="info", help="debug, info, warning (default info)")
    p.set_defaults(func=cmd_responder)


# -- settings ---------------------------------------------------------------------


def _settings(args: argparse.Namespace) -> AtlasSettings:
    return AtlasSettings.resolve(
        atlas_server=getattr(args, "atlas_server", None),
        key_file=getattr(args, "key_file", None),
        ca_bundle=getattr(args, "ca_bundle", None),
        database_url=getattr(args, "database_url", None),
    )


def _warn(exc: KickassError) -> None:
    print(f"WARNING: {exc.message}" + (f"\nhint: {exc.hint}" if exc.hint else ""), file=sys.stderr)


def _progress() -> Callable[[str], None]:
    if sys.stderr.isatty():
        return lambda msg: print(msg, file=sys.stderr, flush=True)
    return lambda _msg: None


def _iso(value: datetime | None) -> str | None:
    return None if value is None else value.isoformat()


# -- plan -------------------------------------------------------------------------


def render_plan(plan: Plan) -> str:
    c = plan.campaign
    head = (
        f"campaign {c.name}: {len(plan.measurements)} measurements, {c.probes.count} probes "
        f"({c.probes.selector} {c.probes.value}), every {c.interval_s} s for {c.duration_s} s, "
        f"{c.packets} packets {c.packet_interval_ms} ms apart"
    )
    cols = (
        "key", "phase", "target", "IP len", "size", "probes", "results/probe", "credits/result",
        "credits",
    )  # fmt: skip
    rows = [
        (
            m.key, m.phase, m.target, m.ip_len, m.size, m.probes, m.results_per_probe,
            m.credits_per_result, m.credits,
        )
        for m in plan.measurements
    ]  # fmt: skip
    widths = [max(len(str(x)) for x in col) for col in zip(cols, *rows, strict=True)]
    lines = [head, "  ".join(str(h).rjust(w) for h, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(str(x).rjust(w) for x, w in zip(r, widths, strict=True)) for r in rows]
    verdict = "within" if plan.total_credits <= c.credit_budget else "ABOVE"
    lines.append(
        f"total {plan.total_credits} credits, {verdict} the budget of {c.credit_budget}"
        + ("" if plan.all_sizes else f" (whole sizes: a sample of {c.whole_sample}; "
           "--all-sizes for every one)")
    )  # fmt: skip
    lines.append(
        f"split sweep: {len(c.splits)} leading-fragment lengths ({c.splits[0]}..{c.splits[-1]}) "
        "in one measurement, one split per reply"
    )
    return "\n".join(lines)


def cmd_plan(args: argparse.Namespace) -> int:
    plan = service.plan(Campaign.load(args.campaign), all_sizes=args.all_sizes)
    if args.json:
        print(json.dumps(plan.to_json(), indent=2))
    else:
        print(render_plan(plan))
    plan.check_budget()
    return 0


# -- create -----------------------------------------------------------------------


def cmd_create(args: argparse.Namespace) -> int:
    if args.dry_run:
        return cmd_plan(args)
    campaign = Campaign.load(args.campaign)
    if args.start_in < 0:
        raise KickassError("--start-in must be 0 or more seconds", hint="the default is 120")
    out = service.create(
        _settings(args),
        campaign,
        all_sizes=args.all_sizes,
        warn=_warn,
        start_in_s=args.start_in,
    )
    if args.json:
        print(json.dumps(out.to_json(), indent=2))
    else:
        created = out.created
        print(
            f"campaign {campaign.name}: created {len(created)} measurements"
            + (f" ({', '.join(map(str, created))})" if created else " (all existed already)")
        )
        for m in out.measurements:
            print(
                f"  {m['key']:>12}  msm {m['msm_id']}  {m['status'] or '?':<20} "
                f"~{m['estimated_credits']} credits"
            )
        print(f"next: kickass atlas responder {args.campaign} (root), then kickass atlas fetch")
    return 0


# -- fetch and status -----------------------------------------------------------------


def cmd_fetch(args: argparse.Namespace) -> int:
    campaign = Campaign.load(args.campaign)
    if args.chunk < 1 or args.settle < 0 or args.late_horizon < 0:
        raise KickassError(
            "--chunk must be at least 1 second, --settle and --late-horizon 0 or more",
            hint="see kickass atlas fetch --help",
        )
    report = service.fetch(
        _settings(args),
        campaign,
        settle_s=args.settle,
        chunk_s=args.chunk,
        late_horizon_s=args.late_horizon,
        progress=_progress(),
    )
    return _print_report(args, campaign, report, "new results")


def cmd_import(args: argparse.Namespace) -> int:
    campaign = Campaign.load(args.campaign)
    report = service.import_results(
        _settings(args), campaign, [str(f) for f in args.files], progress=_progress()
    )
    _print_report(args, campaign, report, "results imported")
    if not args.json:
        for where, reason in report.skipped[:SHOWN_SKIPPED]:
            print(f"  skipped {where.where()}: {reason}")
        if len(report.skipped) > SHOWN_SKIPPED:
            more = len(report.skipped) - SHOWN_SKIPPED
            print(f"  ... and {more} more skipped (--json lists every one)")
    if report.skipped:
        print(
            f"{len(report.skipped)} lines skipped: nothing of them was stored",
            file=sys.stderr,
        )
        return EXIT_SKIPPED
    return 0


def _print_report(
    args: argparse.Namespace, campaign: Campaign, report: FetchReport, what: str
) -> int:
    for w in report.warnings:
        _warn(w)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    ignored = sum(report.ignored.values())
    late = f", {report.results_late} uploaded late" if report.results_late else ""
    print(
        f"campaign {campaign.name}: {report.results_new} {what} from {report.measurements} "
        f"measurements ({report.results_seen} seen{late}, {ignored} ignored), "
        f"{len(report.probes)} probes"
    )
    if report.outcomes:
        print(
            "  echo requests: " + ", ".join(f"{k} {v}" for k, v in sorted(report.outcomes.items()))
        )
    if report.join:
        print(
            "  join to the reply log: "
            + ", ".join(f"{k} {v}" for k, v in sorted(report.join.items()))
        )
    for reason, n in sorted(report.ignored.items()):
        print(f"  ignored {n}: {reason}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    campaign = Campaign.load(args.campaign)
    status = service.status(_settings(args), campaign, offline=args.offline, warn=_warn)
    if args.json:
        print(json.dumps(status.to_json(), indent=2, default=str))
        return 0
    msms = status.measurements
    print(f"campaign {campaign.name}: {len(msms)} measurements")
    for m in msms:
        fetched = _iso(m["fetched_until"]) or "never"
        extra = "".join(
            f", {m[k]} {label}"
            for k, label in (("results_late", "late"), ("results_invalid", "invalid"))
            if m.get(k)
        )
        print(
            f"  msm {m['msm_id']:>10}  {m['phase']:>5} {m['ip_len']:>4}  "
            f"{m['status_name'] or 'unknown':<18}  results {m['results_fetched']:>6}{extra}  "
            f"credits {m['credits_spent']:>7}  fetched until {fetched}"
            + (f"  last error: {m['last_error']}" if m["last_error"] else "")
        )
    print(
        f"credits spent {status.credits_spent} of ~{status.credits_estimated} planned "
        f"(budget {campaign.credit_budget})"
    )
    print(f"replies logged by the responder: {status.replies_logged}")
    if status.verdicts:
        print(
            "probe verdicts: " + ", ".join(f"{k} {v}" for k, v in sorted(status.verdicts.items()))
        )
    return 0


# -- the responder ------------------------------------------------------------------


def cmd_responder(args: argparse.Namespace) -> int:
    from .responder import (
        IcmpResponder,
        check_addresses,
        kernel_echo_replies_off,
        new_run_id,
        undo_kernel_switch,
    )
    from .responder_core import ResponderConfig, ResponderCore

    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.INFO),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.undo:
        done = undo_kernel_switch()
        print("kernel echo replies restored" if done else "nothing to undo")
        return 0
    if args.campaign is None:
        raise KickassError("which campaign?", hint="kickass atlas responder CAMPAIGN.yaml")
    campaign = Campaign.load(args.campaign)
    addresses = sorted({campaign.whole_target, campaign.split_target})
    check_addresses(addresses)
    limits = campaign.responder
    core = ResponderCore(
        ResponderConfig(
            whole_addresses=frozenset({campaign.whole_target}),
            split_addresses=frozenset({campaign.split_target}),
            splits=campaign.splits,
            pps_per_address=limits.pps_per_address,
            pps_per_prefix=limits.pps_per_prefix,
            pps_global=limits.pps_global,
        ),
        now=time.time(),
    )
    writer: OrderedWriter[list[ReplyRecord]] | None = None
    store: AtlasStore | None = None
    sink = None
    if not args.no_database:
        from kickass_db.writer import OrderedWriter

        store = _settings(args).store()
        campaign_id = store.upsert_campaign(campaign)
        run = new_run_id()
        writer = OrderedWriter(
            lambda batch: store.write_reply_log(campaign_id, run, batch), name="kickass-reply-log"
        )
        sink = writer.submit

    responder = IcmpResponder(core, sink)

    def stop(signum: int, _frame: object) -> None:
        log.info("signal %d: stopping", signum)
        responder.stop()

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        with kernel_echo_replies_off(addresses):
            responder.serve(
                ready=lambda: print(
                    f"responder ready on {', '.join(addresses)} "
                    f"(whole {campaign.whole_target}, split {campaign.split_target}, "
                    f"{len(campaign.splits)} splits)",
                    flush=True,
                )
            )
    finally:
        if writer is not None:
            if not writer.sync(timeout=60):
                log.warning("reply log: writes still pending at exit")
            writer.close()
        if store is not None:
            store.close()
        print(f"responder stopped: {responder.summary()}", flush=True)
    if writer is not None and writer.dropped:
        raise KickassError(
            f"{writer.dropped} reply log batches could not be written",
            hint="their replies will read as unanswered; check the database",
        )
    return 0
