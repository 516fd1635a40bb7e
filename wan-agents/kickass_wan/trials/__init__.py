"""The trial runner (`kickass trials`): interleaved periods of Kick-Ass and TCP
towards remote receivers, and what a round needs around them.

- ``schedule`` and ``workload``: the periods and the flows (pure: a seed and
  the settings in, the same periods and flows out);
- ``runner``: a round against the receivers' agents (the shell: HTTP, the
  senders, the deadlines);
- ``service``: one round as a function, the part cron and the scheduler call;
- ``spool`` and ``uploader``: the local outbox and its upload to the server;
- ``receivers``: registering a deployed receiver and checking it before a round.

The receiver's side is ``kickass_wan.agent``; the flows' wire (tokens, the
TCP flow) is ``kickass_wan.token`` and ``kickass_wan.tcpflow``, used by both.
"""
