"""One round of wide-area trials as a plain function: settings in, results out.

``RoundSettings`` is the one typed description of a trial round, whether it
comes from `kickass trials run` flags, from a ``[trials]`` table of a TOML
file (``--config``), or from a scheduled item of `kickass schedule`
(kickass_operations). ``run_round`` runs it: builds the agents, the spool and
the uploader, runs the interleaved periods, and returns the runner's result.
Neither prints nor exits.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self

from kickass_core import config
from kickass_core.errors import KickassError
from kickass_core.flow_record import (
    CONGESTION_CONTROL_RE,
    DEFAULT_CONGESTION_CONTROL,
    HANDSHAKES,
    PROTOCOLS,
)
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .runner import AgentRef, TrialConfig, TrialRunner
from .schedule import Arm, Period, default_arms, parse_arms
from .spool import Spool
from .uploader import Uploader
from .workload import Workload

SECTION = "trials"


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class AgentSetting(_Model):
    """A remote receiver: its name, its control URL (an IP literal), and
    where its secret is (a file; else $KICKASS_AGENT_SECRET)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    url: Annotated[str, Field(pattern=r"^https?://", max_length=200)]
    secret_file: str | None = None


class WorkloadSetting(_Model):
    mean_gap_s: Annotated[float, Field(gt=0, le=3600)] = 0.5
    mean_packets: Annotated[float, Field(gt=1, le=1_000_000)] = 100.0
    min_packets: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    max_packets: Annotated[int, Field(ge=1, le=1_000_000)] = 2000
    shape: Annotated[float, Field(gt=1, le=10)] = 1.8
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 1
    # The paper's 1..2000 taken literally (the Pareto scale at the minimum,
    # so short flows occur) instead of the mean of 100 (workload.py).
    literal_range: bool = False
    # "open" or "closed" (the paper's on-off senders: workload.py).
    loop: Literal["open", "closed"] = "open"


class ScheduleSettings(_Model):
    """What decides the periods and their flows (`kickass trials plan` needs
    only this; a round adds the agents and where results go)."""

    pairs: Annotated[int, Field(ge=1, le=10_000)] = 3
    period_s: Annotated[float, Field(gt=0, le=86_400)] = 120.0
    protocols: Annotated[list[Literal[PROTOCOLS]], Field(min_length=1, max_length=2)] = Field(  # type: ignore[valid-type]  # Literal of a tuple: pydantic expands it, mypy cannot
        default_factory=lambda: list(PROTOCOLS)
    )
    workload: WorkloadSetting = Field(default_factory=WorkloadSetting)
    sender_index: Annotated[int, Field(ge=0, le=1_000_000)] = 0
    # What the periods of a pair run (schedule.parse_arms): e.g. ["kickass",
    # "tcp:cubic", "tcp:reno", "tcp:bbr"]; an A/A calibration ["tcp:cubic",
    # "tcp:cubic"]. None: Kick-Ass and TCP (protocols, congestion_control).
    arms: (
        Annotated[list[Annotated[str, Field(max_length=64)]], Field(min_length=1, max_length=8)]
        | None
    ) = None
    gap_s: Annotated[float, Field(ge=0, le=3600)] = 10.0

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "trial settings") -> Self:
        """Validated settings, or KickassError naming the field that is wrong."""
        try:
            return cls.model_validate(dict(data))
        except ValidationError as exc:
            first = exc.errors(include_url=False, include_input=False)[0]
            field = ".".join(str(p) for p in first.get("loc", ())) or "settings"
            raise KickassError(
                f"{where}: {field}: {first.get('msg')}",
                hint="see wan-agents/README.md, 'Trial settings'",
            ) from None

    def arm_objs(
        self, congestion_control: str = DEFAULT_CONGESTION_CONTROL, handshake: str = "padded"
    ) -> tuple[Arm, ...]:
        try:
            if self.arms is not None:
                arms = parse_arms(
                    self.arms, congestion_control=congestion_control, handshake=handshake
                )
            else:
                arms = default_arms(tuple(self.protocols), congestion_control, handshake)
        except ValueError as exc:
            raise KickassError(f"trial settings: arms: {exc}") from None
        mixed = [a.name for a in arms if a.tcp_share]
        if mixed and self.workload.loop == "closed":
            # A sender's next flow would wait for the end of a flow of the
            # other protocol, which the other sender process runs.
            raise KickassError(
                f"trial settings: arms: {', '.join(mixed)} mixes protocols in one period, "
                "which a closed loop cannot",
                hint="use an open loop (--loop open) for arms with @tcpNN",
            )
        return arms

    def workload_obj(self) -> Workload:
        w = self.workload
        try:
            if w.literal_range:
                return Workload.literal(
                    min_packets=w.min_packets,
                    max_packets=w.max_packets,
                    shape=w.shape,
                    mean_gap_s=w.mean_gap_s,
                    seed=w.seed,
                    loop=w.loop,
                )
            return Workload(
                min_packets=w.min_packets,
                max_packets=w.max_packets,
                shape=w.shape,
                mean_packets=w.mean_packets,
                mean_gap_s=w.mean_gap_s,
                seed=w.seed,
                loop=w.loop,
            )
        except ValueError as exc:
            raise KickassError(f"bad workload: {exc}") from None


class RoundSettings(ScheduleSettings):
    """A trial round: towards whom, for how long, with what workload, and
    where the results go."""

    agents: Annotated[list[AgentSetting], Field(min_length=1, max_length=64)]
    congestion_control: Annotated[str, Field(pattern=CONGESTION_CONTROL_RE.pattern)] = (
        DEFAULT_CONGESTION_CONTROL
    )
    handshake: Literal[HANDSHAKES] = "padded"  # type: ignore[valid-type]  # Literal of a tuple: pydantic expands it, mypy cannot
    access_capacity_bps: Annotated[float, Field(gt=0)] | None = None
    router_run_name: str | None = None
    ka_send: str | None = None
    bind: str | None = None
    # Both protocols alike: the timeout from when a flow is due, the flows in
    # progress at once, and the TCP metrics cache ("disable" for the trial).
    flow_timeout_s: Annotated[float, Field(gt=0, le=3600)] = 60.0
    max_concurrent: Annotated[int, Field(ge=1, le=100_000)] = 256
    tcp_metrics: Literal["disable", "leave"] = "disable"
    agent_retry_s: Annotated[float, Field(ge=0, le=3600)] = 30.0
    # Where the results go: the spool always, the server when one is named.
    spool_dir: str = ".kickass/spool"
    server: str | None = None
    runner_token_file: str | None = None

    def agent_refs(self, secret_dir: str | Path | None = None) -> list[AgentRef]:
        out = []
        for a in self.agents:
            path = a.secret_file or (Path(secret_dir) / a.name if secret_dir else None)
            secret = config.read_secret(
                path,
                "KICKASS_AGENT_SECRET",
                f"secret of agent {a.name}",
                "a secret_file per agent (--secret-dir DIR) or KICKASS_AGENT_SECRET",
            )
            if not secret:
                raise KickassError(
                    f"no secret for agent {a.name}",
                    hint="secret_file, --secret-dir or KICKASS_AGENT_SECRET",
                )
            out.append(AgentRef(a.name, a.url, secret))
        return out

    def trial_config(self, secret_dir: str | Path | None = None) -> TrialConfig:
        return TrialConfig(
            agents=self.agent_refs(secret_dir),
            pairs=self.pairs,
            period_s=self.period_s,
            workload=self.workload_obj(),
            congestion_control=self.congestion_control,
            handshake=self.handshake,
            access_capacity_bps=self.access_capacity_bps,
            router_run_name=self.router_run_name,
            ka_send=self.ka_send,
            source=self.bind,
            protocols=tuple(self.protocols),
            arms=self.arm_objs(self.congestion_control, self.handshake),
            sender_index=self.sender_index,
            agent_retry_s=self.agent_retry_s,
            gap_s=self.gap_s,
            flow_timeout_s=self.flow_timeout_s,
            max_concurrent=self.max_concurrent,
            tcp_metrics=self.tcp_metrics,
        )


def runner_token(path: str | Path | None) -> str:
    hint = (
        "pass --runner-token-file or set KICKASS_RUNNER_TOKEN "
        "(make one on the server: kickass trials runners add NAME)"
    )
    token = config.read_secret(path, "KICKASS_RUNNER_TOKEN", "runner token", hint)
    if not token:
        raise KickassError("no runner token", hint=hint)
    return token


def uploader(server: str, token_file: str | Path | None, spool: Spool) -> Uploader:
    return Uploader(server, runner_token(token_file), spool)


def run_round(
    settings: RoundSettings,
    *,
    secret_dir: str | Path | None = None,
    progress: Callable[[Period], None] | None = None,
    stop: threading.Event | None = None,
    scheduled: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Run one round; its result (trial ids, FCT summary, failures, what is
    still spooled). ``stop`` ends it early (results so far stay spooled).
    ``scheduled`` (item, due time, seed, agents' order) is stored with the
    trial's parameters."""
    cfg = dataclasses.replace(settings.trial_config(secret_dir), scheduled=scheduled)
    spool = Spool(settings.spool_dir)
    up = uploader(settings.server, settings.runner_token_file, spool) if settings.server else None
    runner = TrialRunner(cfg, spool, up)
    if stop is not None:
        runner.stop = stop
    return runner.run(progress=progress)
