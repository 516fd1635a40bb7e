"""`kickass report`: one self-contained HTML file of everything measured.

    write_report(database_url, path, campaign=None, since=None) -> ReportResult

Five sections, each a few figures (inline SVG, ``figures``) and tables, every
number from ``kickass_analysis.stats`` (so it agrees with the notebooks, the
dashboards' rollups and the volunteer's page), the paper's numbers beside
ours:

- **the study**: drop rate against packet size and against the split's
  leading-fragment length, with Wilson intervals, by source (volunteers,
  RIPE Atlas); the share of fragment-intolerant clients overall, by country
  and by network (ASN), the paper's 8.3% of 405 beside it;
- **the trials**: FCT against flow size per access capacity and arm (the
  workload's floor stated: by default no flow is under 46 packets), the
  Kick-Ass flows that fell back to TCP per arm, the paired speedup with its
  interval over period pairs (``v_trial_speedups``, the ``refresh`` rollup)
  and beside it the share of matched flows finished sooner under Kick-Ass,
  failures kept, with completion per arm; the CDF of the time in Kick-Ass
  mode; the paper's 1.2-4x beside it;
- **the router**: advertised rate, leading-fragment length, queue and mode
  over time;
- **the congestion experiments** (paper §III-D, ``experiments_section``):
  per run every flow's rate over time, the router's TCP mode shaded, fairness,
  utilisation and switch times beside the paper's words;
- **schedule health**: scheduled item runs by outcome and the failures with
  their reasons (``v_item_runs``), the Atlas measurements' status.

Everything is read in one REPEATABLE READ transaction (one snapshot: the
sections agree with each other), from the rollups the scheduled ``refresh``
keeps (so a report stays under a second a section at ten million probes, a
million flows and a month of router telemetry: bench/dashboards_bench.py)
with what no refresh has seen yet added live: sessions finished since
(``v_drop_rollup``), a router's samples since its last rolled-up second,
and the trials' figures computed from the flows while some are not in
their rollup (``report_fct_bins``, ``report_ka_mode``, migration 0014). The
file needs nothing else: CSS inline, figures inline, no script, no fetch. A
section or figure with nothing to show says "no data yet".

Filters: ``campaign`` keeps the RIPE Atlas parts (results, verdicts,
measurements) to that Atlas campaign; volunteers, trials, the router and the
scheduled runs have no campaign and are shown whole. ``since`` keeps the
study's drop rates from since's UTC day on (the rollup counts by day:
volunteer sessions created, Atlas probes last heard from, that day or
later), clients whose latest verdict and Atlas probes whose verdict came
since then, flows started, router samples from then on (by the run's own
clock: its start plus the sample's t, as its rollups count) and item runs
due since then; the trials' speedup is then computed from those flows
(``rollups.compute``) instead of read from the rollup.

Volunteers' sessions store only an address: their country and network come
from an ip2asn table when one is given (``network_table``,
``kickass_analysis.networks``), else they are "unknown".

The package, by subject: ``readers`` (the SQL, ``ReportData``,
``ReportStore``, ``READERS``, the filters), one module per section
(``study``, ``trials``, ``router``, ``health``; the congestion experiments'
is ``kickass_analysis.experiments_section``), each a function from the data
read to a small typed model (``build``: the statistics) and one from that
model to HTML (``to_html``: prose, tables, figures), ``section`` both;
``markup`` (the HTML pieces every section uses) and ``render`` (the page,
``write_report``).
"""

from .health import section as health_section
from .markup import Section
from .readers import READERS, Filters, ReportData, ReportStore, parse_since
from .render import SECTIONS, ReportResult, render, write_report
from .router import section as router_section
from .study import section as study_section
from .trials import section as trials_section

__all__ = [
    "READERS",
    "SECTIONS",
    "Filters",
    "ReportData",
    "ReportResult",
    "ReportStore",
    "Section",
    "health_section",
    "parse_since",
    "render",
    "router_section",
    "study_section",
    "trials_section",
    "write_report",
]
