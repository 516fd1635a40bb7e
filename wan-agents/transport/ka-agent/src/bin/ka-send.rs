//! `ka-send`: the Kick-Ass transport's sender for the trial runner (see
//! wan-agents/README.md). One flow, or a schedule of flows on stdin run
//! concurrently; one JSON line per flow on stdout.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::process::ExitCode;

use clap::{Parser, ValueEnum};
use ka_agent::send_shell::{
    parse_token, print_json, run, FlowSpec, Output, SendOptions, Source, MAX_FLOW_SIZE,
};
use ka_agent::sys;
use ka_core::units::parse_duration_ns;
use ka_transport::{Config, CongestionControl, HandshakeMode};

#[derive(Debug, Clone, Copy, ValueEnum)]
enum HandshakeArg {
    /// Opening datagram padded to 1500 bytes, DF clear: a router marks it
    /// and the first rate arrives with the handshake reply
    Padded,
    /// The paper's small handshake: the first rate comes one RTT later
    Paper,
}

/// Run Kick-Ass transport flows to a wan agent's receiver.
///
/// One flow:   ka-send --agent IP:PORT --token HEX --size BYTES
///             prints its FlowRecord as one JSON line.
///
/// A schedule: ka-send --agent IP:PORT --schedule -
///             reads NDJSON lines {"flow_id", "start_s", "size_bytes",
///             "token_hex"} from stdin, starts each flow start_s seconds
///             after ka-send started (when fewer than --max-concurrent run),
///             and prints {"flow_id", "record", "error", "queued_ns"} per
///             flow as it ends. Closed loop (the paper's on-off senders):
///             "after": FLOW_ID starts the flow start_s after that flow
///             ended, and "not_after_s": S skips it (and what follows it,
///             printed with "skipped": true) when that is later than S.
///
/// Exit status: 0 every flow completed, 1 otherwise, 2 usage errors.
#[derive(Debug, Parser)]
#[command(name = "ka-send", version, verbatim_doc_comment)]
struct Cli {
    /// The receiver, IPv4 IP:PORT
    #[arg(long)]
    agent: String,
    /// Flow token (hex), from the agent's /v1/tokens
    #[arg(long, conflicts_with = "schedule")]
    token: Option<String>,
    /// Flow size in bytes
    #[arg(long, conflicts_with = "schedule")]
    size: Option<u64>,
    /// Read a schedule of flows ("-" = stdin)
    #[arg(long)]
    schedule: Option<String>,
    #[arg(long, value_enum, default_value = "padded")]
    handshake: HandshakeArg,
    /// TCP mode's congestion control: cubic (RFC 9438 with HyStart, as
    /// Linux) or newreno (the paper's); both with SACK, RACK-TLP and PRR
    #[arg(long, default_value = "cubic")]
    cc: CongestionControl,
    /// This transport as plain TCP (--cc only): DF set, rates ignored
    #[arg(long)]
    tcp_only: bool,
    /// Give up on a flow this many seconds after it was due (its wait for
    /// a concurrency slot included)
    #[arg(long, default_value_t = 60.0)]
    timeout: f64,
    /// Flows in progress at once; later ones wait for a slot (their wait
    /// is reported as queued_ns and counts in their completion time)
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u64).range(1..=100_000))]
    max_concurrent: u64,
    /// Local IPv4 address to send from
    #[arg(long, default_value = "0.0.0.0")]
    bind: Ipv4Addr,
    /// Flow id on the wire (single flow) [default: random]
    #[arg(long)]
    flow_id: Option<u64>,
    /// Every DUR (e.g. 100ms), one line per running flow:
    /// {"type": "progress", "flow_id", "t_ns", "acked_bytes", "ka_mode"}
    /// (per-flow rate and mode over time)
    #[arg(long, value_parser = parse_duration_ns, value_name = "DUR")]
    progress: Option<u64>,
}

fn usage(msg: &str) -> ExitCode {
    eprintln!("ka-send: error: {msg}");
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let agent: SocketAddrV4 = match cli.agent.parse() {
        Ok(a) => a,
        Err(_) => {
            return usage(&format!(
                "--agent must be an IPv4 address and port (IP:PORT), got {:?}",
                cli.agent
            ))
        }
    };
    if agent.port() == 0 || agent.ip().is_unspecified() {
        return usage("--agent needs a real address and a non-zero port");
    }
    if !(cli.timeout.is_finite() && cli.timeout > 0.0 && cli.timeout <= 86_400.0) {
        return usage("--timeout must be between 0 and 86400 seconds");
    }
    let mut cfg = if cli.tcp_only {
        Config::tcp(cli.cc)
    } else {
        Config {
            cc: cli.cc,
            ..Config::default()
        }
    };
    cfg.handshake_mode = match cli.handshake {
        HandshakeArg::Padded => HandshakeMode::Padded,
        HandshakeArg::Paper => HandshakeMode::Paper,
    };
    let source = match (&cli.schedule, &cli.token, cli.size) {
        (Some(s), _, _) => {
            if s != "-" {
                return usage("--schedule takes only \"-\" (stdin)");
            }
            Source::Schedule(0)
        }
        (None, Some(t), Some(size)) => {
            let token = match parse_token(t) {
                Ok(t) => t,
                Err(e) => return usage(&format!("--token: {e}")),
            };
            if !(1..=MAX_FLOW_SIZE).contains(&size) {
                return usage(&format!("--size must be from 1 to {MAX_FLOW_SIZE} bytes"));
            }
            let wire_id = cli.flow_id.unwrap_or_else(sys::random_u64);
            Source::One(FlowSpec {
                label: wire_id.to_string(),
                wire_id,
                start: 0,
                size,
                token,
                after: None,
                not_after: None,
            })
        }
        _ => return usage("give --token and --size for one flow, or --schedule - for many"),
    };
    let single = matches!(source, Source::One(_));
    if let Err(e) = sys::install_stop_handlers() {
        eprintln!("ka-send: error: {e}");
        return ExitCode::from(1);
    }
    let opts = SendOptions {
        agent,
        bind: cli.bind,
        cfg,
        timeout: (cli.timeout * 1e9) as u64,
        linger: 3_000_000_000,
        max_concurrent: cli.max_concurrent as usize,
        progress_interval: cli.progress.filter(|&p| p > 0),
    };
    let mut out = std::io::stdout().lock();
    let mut stdout_ok = true;
    let result = run(
        opts,
        source,
        |o| {
            let r = match o {
                Output::Flow(r) => r,
                Output::Progress(p) => {
                    if !print_json(&mut out, p) && stdout_ok {
                        stdout_ok = false;
                        eprintln!("ka-send: error: cannot write to stdout");
                    }
                    return;
                }
            };
            let ok = if single {
                match &r.record {
                    Some(rec) => print_json(&mut out, rec),
                    None => print_json(&mut out, r),
                }
            } else {
                print_json(&mut out, r)
            };
            if !ok && stdout_ok {
                stdout_ok = false;
                eprintln!("ka-send: error: cannot write to stdout");
            }
            if single {
                if let Some(e) = &r.error {
                    eprintln!("ka-send: flow {}: {e}", r.flow_id);
                }
            }
        },
        |w| eprintln!("ka-send: error: {w}"),
    );
    match result {
        Err(e) => {
            eprintln!("ka-send: error: {e}");
            ExitCode::from(1)
        }
        Ok(s) if s.bad_lines > 0 => ExitCode::from(2),
        Ok(s) if s.completed == s.flows && !s.interrupted && stdout_ok => ExitCode::from(0),
        Ok(_) => ExitCode::from(1),
    }
}
