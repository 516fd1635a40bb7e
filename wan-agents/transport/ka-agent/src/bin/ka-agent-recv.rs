//! `ka-agent-recv`: the Kick-Ass receiver of a wan agent (see
//! wan-agents/README.md). Run by `kickass-agent`, which restarts it if it
//! dies and hands it the agent secret in KICKASS_AGENT_SECRET_HEX.

use std::net::{Ipv4Addr, SocketAddrV4};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use ka_agent::recv_shell::{run, RecvOptions};
use ka_agent::sys;
use ka_agent::token::unhex;

const SECRET_ENV: &str = "KICKASS_AGENT_SECRET_HEX";

/// Kick-Ass transport receiver: serves flows that carry a valid token,
/// echoes the rate routers wrote into each datagram's leading fragment
/// (read before reassembly with an AF_PACKET socket, so it needs
/// CAP_NET_RAW), and prints one NDJSON line per finished flow, and its
/// counters on SIGTERM. The agent secret comes from KICKASS_AGENT_SECRET_HEX.
#[derive(Debug, Parser)]
#[command(name = "ka-agent-recv", version)]
struct Cli {
    /// UDP port to serve
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..))]
    port: u16,
    /// IPv4 address to bind
    #[arg(long, default_value = "0.0.0.0")]
    bind: Ipv4Addr,
    /// Read leading fragments on this interface only [default: every interface]
    #[arg(long)]
    interface: Option<String>,
    /// Append used token nonces here ("nonce_hex:expires" lines, the Python
    /// agent's format) and refuse those already listed
    #[arg(long)]
    state_file: Option<PathBuf>,
    /// Run without the AF_PACKET socket (no CAP_NET_RAW needed): no rate
    /// can be read, so every flow is accepted as TCP
    #[arg(long)]
    no_leading_fragments: bool,
    /// Flows open at once
    #[arg(long, default_value_t = 1024, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    max_flows: u64,
    /// Forget a flow silent for this many seconds
    #[arg(long, default_value_t = 30.0)]
    idle_timeout: f64,
    /// Do not compare delivered bytes with the sender's pattern
    #[arg(long)]
    no_verify_payload: bool,
}

fn fail(code: u8, msg: &str) -> ExitCode {
    eprintln!("ka-agent-recv: error: {msg}");
    ExitCode::from(code)
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let Some(secret) = std::env::var(SECRET_ENV)
        .ok()
        .filter(|s| !s.trim().is_empty())
    else {
        let hint = "the agent secret, in hex (kickass-agent sets it)";
        return fail(2, &format!("{SECRET_ENV} is not set\n  hint: {hint}"));
    };
    let Some(secret) = unhex(&secret) else {
        return fail(2, &format!("{SECRET_ENV} is not hex"));
    };
    if secret.len() < 16 {
        return fail(
            2,
            &format!(
                "the agent secret is too short ({} bytes; use at least 16)",
                secret.len()
            ),
        );
    }
    if !(cli.idle_timeout.is_finite() && cli.idle_timeout > 0.0 && cli.idle_timeout <= 86_400.0) {
        return fail(2, "--idle-timeout must be between 0 and 86400 seconds");
    }
    let idx = match &cli.interface {
        Some(name) if !cli.no_leading_fragments => match sys::ifindex(name) {
            Ok(i) => Some(i),
            Err(e) => return fail(2, &e.to_string()),
        },
        _ => None,
    };
    if let Err(e) = sys::install_stop_handlers() {
        return fail(1, &e.to_string());
    }
    let opts = RecvOptions {
        bind: SocketAddrV4::new(cli.bind, cli.port),
        leading_fragments: !cli.no_leading_fragments,
        ifindex: idx,
        interface: cli.interface,
        secret,
        state_file: cli.state_file,
        max_flows: cli.max_flows as usize,
        idle_timeout: (cli.idle_timeout * 1e9) as u64,
        verify_payload: !cli.no_verify_payload,
    };
    match run(opts, std::io::stdout().lock()) {
        Ok(code) => ExitCode::from(code as u8),
        Err(e) => fail(1, &e.to_string()),
    }
}
