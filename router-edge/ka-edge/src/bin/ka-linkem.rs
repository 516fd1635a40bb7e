//! `ka-linkem`: userspace link emulator bridging two interfaces (see
//! router-edge/README.md). netem is not available here; this is ours.

use clap::Parser;
use ka_core::linkem::LinkConfig;
use ka_core::units::{parse_duration_ns, parse_limit, parse_rate_bps, Limit};
use ka_edge::linkem_shell::{run, Options};
use ka_edge::sys;

/// Bridge --a and --b (AF_PACKET, whole Ethernet frames) through an
/// emulated link: random loss, then a drop-tail queue served at --rate,
/// then a constant one-way --delay. Each setting applies to both
/// directions unless overridden with its -ab / -ba variant (a->b is
/// traffic entering --a and leaving --b).
#[derive(Debug, Parser)]
#[command(name = "ka-linkem", version)]
struct Cli {
    /// First interface
    #[arg(long)]
    a: String,
    /// Second interface
    #[arg(long)]
    b: String,
    /// One-way delay, e.g. 50ms (both directions)
    #[arg(long, value_parser = parse_duration_ns, default_value = "0")]
    delay: u64,
    #[arg(long, value_parser = parse_duration_ns)]
    delay_ab: Option<u64>,
    #[arg(long, value_parser = parse_duration_ns)]
    delay_ba: Option<u64>,
    /// Random loss probability in [0, 1], e.g. 0.01
    #[arg(long, default_value_t = 0.0)]
    loss: f64,
    #[arg(long)]
    loss_ab: Option<f64>,
    #[arg(long)]
    loss_ba: Option<f64>,
    /// Rate limit in tc units, e.g. 100mbit (counts Ethernet frame bytes) [default: none]
    #[arg(long, value_parser = parse_rate_bps)]
    rate: Option<f64>,
    #[arg(long, value_parser = parse_rate_bps)]
    rate_ab: Option<f64>,
    #[arg(long, value_parser = parse_rate_bps)]
    rate_ba: Option<f64>,
    /// Drop-tail queue in front of the rate limit: packets (1000p) or bytes (1500000b)
    #[arg(long, value_parser = parse_limit, default_value = "1000p")]
    queue: Limit,
    #[arg(long, value_parser = parse_limit)]
    queue_ab: Option<Limit>,
    #[arg(long, value_parser = parse_limit)]
    queue_ba: Option<Limit>,
    /// Seed of the loss process (same seed, same losses)
    #[arg(long)]
    seed: Option<u64>,
    /// Write JSON counters (one line per --stats-interval, and at exit) here ("-" = stdout)
    #[arg(long)]
    stats: Option<String>,
    #[arg(long, value_parser = parse_duration_ns, default_value = "1s")]
    stats_interval: u64,
    /// Spin for the last part of every wait: a sleeping thread wakes up to
    /// ~1 ms late on a busy VM; spinning trades CPU for delay accuracy
    #[arg(long, value_parser = parse_duration_ns, default_value = "200us")]
    spin: u64,
    /// SCHED_FIFO priority (0 = ordinary scheduling): a release due now
    /// preempts other processes instead of waiting for a time slice. The
    /// loop always sleeps between releases, so it cannot monopolise a core
    /// at low load; the kernel's RT throttling bounds it at high load.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(i32).range(0..=99))]
    rt_priority: i32,
}

fn link(delay: u64, loss: f64, rate: Option<f64>, queue: Limit) -> Result<LinkConfig, sys::Error> {
    if !(0.0..=1.0).contains(&loss) {
        return Err(sys::Error::new(format!(
            "loss must be a probability between 0 and 1, got {loss}"
        )));
    }
    Ok(LinkConfig {
        delay_ns: delay,
        loss,
        rate_bps: rate,
        queue,
    })
}

fn options(c: Cli) -> Result<Options, sys::Error> {
    let ab = link(
        c.delay_ab.unwrap_or(c.delay),
        c.loss_ab.unwrap_or(c.loss),
        c.rate_ab.or(c.rate),
        c.queue_ab.unwrap_or(c.queue),
    )?;
    let ba = link(
        c.delay_ba.unwrap_or(c.delay),
        c.loss_ba.unwrap_or(c.loss),
        c.rate_ba.or(c.rate),
        c.queue_ba.unwrap_or(c.queue),
    )?;
    if c.stats_interval == 0 {
        return Err(sys::Error::new(
            "--stats-interval must be greater than zero",
        ));
    }
    Ok(Options {
        a: c.a,
        b: c.b,
        ab,
        ba,
        seed: c.seed.unwrap_or_else(sys::now),
        stats: c.stats,
        stats_interval_ns: c.stats_interval,
        spin_ns: c.spin,
        rt_priority: c.rt_priority,
    })
}

fn main() {
    let cli = Cli::parse();
    let code = match options(cli).and_then(run) {
        Ok(()) => 0,
        Err(e) => sys::report("ka-linkem", &e),
    };
    std::process::exit(code);
}
