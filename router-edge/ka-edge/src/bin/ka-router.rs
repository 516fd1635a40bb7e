//! `ka-router`: the edge Kick-Ass router (see router-edge/README.md).

use clap::{Parser, ValueEnum};
use ka_core::router::{RouterConfig, RouterKind};
use ka_core::units::{parse_duration_ns, parse_limit, parse_rate_bps, Limit};
use ka_edge::router_shell::{run, DatapathKind, Options};
use ka_edge::sys;

#[derive(Debug, Clone, Copy, ValueEnum)]
enum DatapathArg {
    /// AF_PACKET: a receive ring on LAN, sendmmsg on WAN (qdisc bypass); an
    /// nftables rule owned by the router drops the kernel's own copy. LAN ->
    /// WAN bypasses netfilter and policy routing
    Packet,
    /// Policy routing into a TUN device; the kernel forwards what we write
    /// (netfilter, policy routing), at about twice the CPU per datagram
    Tun,
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum ModeArg {
    /// RCP rate advertised by fragmenting (TCP mode above 50% queue).
    Kickass,
    /// Plain rate-limited drop-tail router: the baseline.
    Droptail,
}

/// Kick-Ass router for LAN -> WAN traffic, plain router the other way.
///
/// Packets arriving on --lan are taken from an AF_PACKET ring (or, with
/// --datapath tun, policy-routed into a TUN device), queued (drop-tail) and
/// served at --capacity; full-size DF-clear packets leave cut so the leading
/// fragment length advertises the RCP rate. One JSON telemetry line per
/// control interval goes to stdout or --telemetry.
#[derive(Debug, Parser)]
#[command(name = "ka-router", version)]
struct Cli {
    /// LAN-side interface (traffic from it is Kick-Ass routed)
    #[arg(long)]
    lan: String,
    /// WAN-side interface
    #[arg(long)]
    wan: String,
    /// Link capacity C, e.g. 10mbit, 100mbit, 1gbit (tc units)
    #[arg(long, value_parser = parse_rate_bps)]
    capacity: f64,
    /// Drop-tail buffer: packets (1000p) or bytes (1500000b) [default: one BDP at 100 ms, >= 30 packets]
    #[arg(long, value_parser = parse_limit)]
    buffer: Option<Limit>,
    #[arg(long, value_enum, default_value = "kickass")]
    mode: ModeArg,
    /// How packets reach the router and leave it (see router-edge/README.md)
    #[arg(long, value_enum, default_value = "packet")]
    datapath: DatapathArg,
    /// Packet datapath: slots of the LAN receive ring (TPACKET_V2); 0 reads with recvmmsg
    #[arg(long, default_value_t = 4096)]
    rx_ring_frames: usize,
    /// SCHED_FIFO priority of the router (0 = ordinary scheduling)
    #[arg(long, default_value_t = 0)]
    rt_priority: i32,
    /// RCP alpha (spare-capacity gain; ns-2's is 0.4); the paper's FCT study uses 0.1
    #[arg(long, default_value_t = ka_core::router::DEFAULT_ALPHA)]
    alpha: f64,
    /// RCP beta (queue-drain gain); the paper's FCT study uses 1.0
    #[arg(long, default_value_t = 0.4)]
    beta: f64,
    /// Control interval T [default: min(d, 10ms), re-evaluated as d changes]
    #[arg(long, value_parser = parse_duration_ns)]
    interval: Option<u64>,
    /// Initial advertised rate [default: 0.05 * capacity]
    #[arg(long, value_parser = parse_rate_bps)]
    initial_rate: Option<f64>,
    /// Floor of the advertised rate [default: the smallest encodable rate,
    /// ~120kbit]. Lower floors let R fall below what a fragment can carry:
    /// the router then stops fragmenting and, while TCP-mode flows keep the
    /// link full, R never climbs back (see router-edge/README.md)
    #[arg(long, value_parser = parse_rate_bps)]
    min_rate: Option<f64>,
    /// RTT d assumed until the first RTT indicator arrives
    #[arg(long, value_parser = parse_duration_ns, default_value = "100ms")]
    default_rtt: u64,
    /// EWMA gain of the RTT-indicator average
    #[arg(long, default_value_t = 0.1)]
    rtt_gain: f64,
    /// Enter TCP mode (stop fragmenting) above this fraction of the buffer
    #[arg(long, default_value_t = 0.5)]
    tcp_mode_on: f64,
    /// Leave TCP mode below this fraction of the buffer (hysteresis)
    #[arg(long, default_value_t = 0.4)]
    tcp_mode_off: f64,
    /// With only Kick-Ass's own traffic arriving, enter TCP mode once the
    /// queue has stayed above --tcp-mode-on for this many average RTTs (0:
    /// at once, the paper's rule literally); see README
    #[arg(long, default_value_t = 5.0, value_name = "RTTS")]
    tcp_mode_hold: f64,
    /// Enter TCP mode at once (the paper's rule) when at least this share of
    /// the arriving bytes could never be marked (DF set or not full size:
    /// not Kick-Ass's own traffic); 1 turns the test off
    #[arg(long, default_value_t = 0.05, value_name = "SHARE")]
    unmarkable_share: f64,
    /// End TCP mode, whatever the queue, once under this share of the
    /// arriving bytes could still be marked (traffic that ignores the mode)
    /// and none is unmarkable: Kick-Ass endpoints in TCP mode hold the
    /// queue; 0 turns it off (the queue alone ends the mode)
    #[arg(long, default_value_t = 0.5, value_name = "SHARE")]
    tcp_mode_markable_share: f64,
    /// Let RCP update R in TCP mode too (by default R is held there, and put
    /// back to its value when the queue crossed --tcp-mode-on)
    #[arg(long)]
    no_hold_rate: bool,
    /// Telemetry NDJSON file ("-" = stdout)
    #[arg(long)]
    telemetry: Option<String>,
    /// Name of the TUN device to create
    #[arg(long, default_value = "ka0")]
    tun: String,
    /// Policy-routing table dedicated to the router (flushed at start and exit)
    #[arg(long, default_value_t = 100)]
    table: u32,
    /// Priority of the `ip rule iif LAN` entry
    #[arg(long, default_value_t = 100)]
    rule_priority: u32,
    /// On SIGTERM/SIGINT, keep sending what is queued for at most this long
    #[arg(long, value_parser = parse_duration_ns, default_value = "2s")]
    drain_timeout: u64,
    /// Pacer lateness that may be caught up in one burst
    #[arg(long, value_parser = parse_duration_ns, default_value = "1ms")]
    max_burst: u64,
    /// Spin instead of sleeping when the next departure is this close
    #[arg(long, value_parser = parse_duration_ns, default_value = "20us")]
    spin: u64,
    /// Do not give back the extra TTL decrement of the TUN detour
    #[arg(long)]
    no_ttl_fix: bool,
    /// Seed of the randomised first control timer
    #[arg(long)]
    seed: Option<u64>,
}

fn options(c: Cli) -> Result<Options, sys::Error> {
    let frac = |name: &str, v: f64| {
        if (0.0..=1.0).contains(&v) {
            Ok(v)
        } else {
            Err(sys::Error::new(format!(
                "--{name} must be a fraction between 0 and 1, got {v}"
            )))
        }
    };
    let mut r = RouterConfig::with_capacity(c.capacity);
    r.kind = match c.mode {
        ModeArg::Kickass => RouterKind::KickAss,
        ModeArg::Droptail => RouterKind::DropTail,
    };
    if let Some(b) = c.buffer {
        r.buffer = b;
    }
    if !(c.alpha >= 0.0 && c.beta >= 0.0) {
        return Err(sys::Error::new("--alpha and --beta must be >= 0"));
    }
    r.alpha = c.alpha;
    r.beta = c.beta;
    r.interval_ns = c.interval;
    if c.interval == Some(0) {
        return Err(sys::Error::new("--interval must be greater than zero"));
    }
    if let Some(i) = c.initial_rate {
        r.initial_rate_bps = i;
    }
    if let Some(m) = c.min_rate {
        r.min_rate_bps = m;
    }
    if c.default_rtt == 0 {
        return Err(sys::Error::new("--default-rtt must be greater than zero"));
    }
    r.default_rtt_ms = c.default_rtt as f64 / 1e6;
    r.rtt_gain = frac("rtt-gain", c.rtt_gain)?;
    r.tcp_mode_on = frac("tcp-mode-on", c.tcp_mode_on)?;
    r.tcp_mode_off = frac("tcp-mode-off", c.tcp_mode_off)?;
    if !(c.tcp_mode_hold >= 0.0 && c.tcp_mode_hold <= 100.0) {
        return Err(sys::Error::new(
            "--tcp-mode-hold must be between 0 and 100 RTTs",
        ));
    }
    r.tcp_mode_hold_rtts = c.tcp_mode_hold;
    r.unmarkable_share = frac("unmarkable-share", c.unmarkable_share)?;
    r.tcp_mode_markable_share = frac("tcp-mode-markable-share", c.tcp_mode_markable_share)?;
    r.hold_rate_in_tcp_mode = !c.no_hold_rate;
    if r.tcp_mode_off > r.tcp_mode_on {
        return Err(sys::Error::new(
            "--tcp-mode-off must not exceed --tcp-mode-on",
        ));
    }
    r.max_burst_ns = c.max_burst;
    r.seed = c.seed.unwrap_or_else(sys::now);
    Ok(Options {
        lan: c.lan,
        wan: c.wan,
        datapath: match c.datapath {
            DatapathArg::Tun => DatapathKind::Tun,
            DatapathArg::Packet => DatapathKind::Packet,
        },
        rx_ring_frames: c.rx_ring_frames,
        rt_priority: c.rt_priority,
        tun: c.tun,
        table: c.table,
        rule_priority: c.rule_priority,
        telemetry: c.telemetry,
        drain_timeout_ns: c.drain_timeout,
        spin_ns: c.spin,
        ttl_fix: !c.no_ttl_fix,
        router: r,
    })
}

fn main() {
    let cli = Cli::parse();
    let code = match options(cli).and_then(run) {
        Ok(()) => 0,
        Err(e) => sys::report("ka-router", &e),
    };
    std::process::exit(code);
}
