"""RIPE Atlas campaigns for the fragment viability study.

Atlas probes ping the server's ICMP responder (``kickass_atlas.responder``),
which answers with whole or split echo replies and logs every reply it sent;
``kickass atlas`` plans and creates the measurements (Cousteau), fetches their
results (Cousteau + Sagan), joins them to the reply log and stores them beside
the volunteers' results, comparable row for row. See README.md in this folder.

    campaign.py  the campaign YAML as data: validation, the plan, its credit cost
    client.py    Cousteau behind one small class; Atlas errors as KickassError
    ingest/      result parsing (Sagan + raw), the check against the columns' bounds,
                 the join to the reply log (pure), fetch windows into the store
    result_files.py  `kickass atlas import`: result files line by line, each checked
    rows.py      the Atlas tables' rows as plain records (what the join makes)
    store.py     the only code that writes the Atlas tables
    cli.py       `kickass atlas plan|create|fetch|status|responder`
"""
