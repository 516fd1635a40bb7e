//! The IO shell of `ka-linkem`: two AF_PACKET ports bridged through two
//! emulated link directions (A -> B and B -> A), in one thread.
//!
//! Frames are read as soon as they arrive (timestamped then), held by the
//! sans-IO [`Link`] and written when due; the thread sleeps with ppoll and
//! 1 ns timer slack, and spins for the last few microseconds, so release
//! times are accurate to the wake-up latency (tens of microseconds).

use std::io::Write;

use ka_core::linkem::{Link, LinkConfig, LinkStats};
use ka_core::Nanos;
use serde::Serialize;

use crate::afpacket::{PacketSocket, VNET_HDR_LEN};
use crate::pool::Pool;
use crate::sys::{self, Error, Result};

#[derive(Debug, Clone, Serialize)]
pub struct Options {
    pub a: String,
    pub b: String,
    pub ab: LinkConfig,
    pub ba: LinkConfig,
    pub seed: u64,
    pub stats: Option<String>,
    pub stats_interval_ns: Nanos,
    pub spin_ns: Nanos,
    pub rt_priority: i32,
}

#[derive(Serialize)]
struct StatsLine<'a> {
    #[serde(rename = "type")]
    kind: &'static str,
    ts: f64,
    ab: &'a LinkStats,
    ba: &'a LinkStats,
    send_errors: u64,
}

struct Port {
    sock: PacketSocket,
    pool: Pool,
}

fn pump_in(port: &mut Port, link: &mut Link) -> Result<usize> {
    let mut n = 0;
    while n < 256 {
        let mut buf = port.pool.get();
        match port.sock.recv(&mut buf) {
            Ok(Some(len)) => {
                // Stamp after the read, never before: a frame must not be
                // credited with time it spent before it reached us, or it
                // would leave early if this thread was preempted.
                let now = sys::now();
                buf.truncate(len);
                let wire = len.saturating_sub(VNET_HDR_LEN);
                if let Err(b) = link.on_packet(now, buf, wire) {
                    port.pool.put(b);
                }
                n += 1;
            }
            Ok(None) => {
                port.pool.put(buf);
                break;
            }
            Err(e) => {
                return Err(Error::new(format!(
                    "receiving on {} failed: {e}",
                    port.sock.name
                )));
            }
        }
    }
    Ok(n)
}

/// Send what is due on `out`; the emptied buffers go back to `pool_of`
/// (the port they were read from).
fn pump_out(link: &mut Link, out: &PacketSocket, pool_of: &mut Pool, now: Nanos, errors: &mut u64) {
    while let Some(frame) = link.poll_transmit(now) {
        if let Err(e) = out.send(&frame) {
            // ENOBUFS and friends: the frame is lost, like on a real wire.
            *errors += 1;
            if errors.is_power_of_two() {
                eprintln!(
                    "ka-linkem: send on {} failed ({} so far): {e}",
                    out.name, errors
                );
            }
        }
        pool_of.put(frame);
    }
}

pub fn run(o: Options) -> Result<()> {
    sys::require_net_caps("ka-linkem")?;
    if o.a == o.b {
        return Err(Error::new("--a and --b must be different interfaces"));
    }
    sys::ifindex(&o.a)?;
    sys::ifindex(&o.b)?;
    let frame = sys::iface_mtu(&o.a)?.max(sys::iface_mtu(&o.b)?) + 64 + VNET_HDR_LEN;
    let rcvbuf = 8 << 20;
    let mut pa = Port {
        sock: PacketSocket::open(&o.a, rcvbuf)?,
        pool: Pool::new(frame, 4096),
    };
    let mut pb = Port {
        sock: PacketSocket::open(&o.b, rcvbuf)?,
        pool: Pool::new(frame, 4096),
    };
    sys::install_stop_handlers()?;
    sys::tight_timer_slack();
    if o.rt_priority > 0 && !sys::realtime_priority(o.rt_priority) {
        eprintln!(
            "ka-linkem: warning: SCHED_FIFO not permitted; delay jitter will follow the scheduler"
        );
    }
    let mut stats_out: Option<Box<dyn Write>> = match o.stats.as_deref() {
        None => None,
        Some("-") => Some(Box::new(std::io::stdout())),
        Some(p) => Some(Box::new(std::fs::File::create(p).map_err(|e| {
            Error::new(format!("cannot create stats file {p}: {e}"))
        })?)),
    };
    let mut ab = Link::new(o.ab.clone(), o.seed);
    let mut ba = Link::new(o.ba.clone(), o.seed ^ 0x5bd1_e995);
    eprintln!(
        "ka-linkem: {} <-> {}: a->b delay {} ns loss {} rate {:?}; b->a delay {} ns loss {} rate {:?}",
        o.a, o.b, o.ab.delay_ns, o.ab.loss, o.ab.rate_bps, o.ba.delay_ns, o.ba.loss, o.ba.rate_bps
    );
    let fds = [pa.sock.fd(), pb.sock.fd()];
    // Which fd woke us does not matter: every pass reads them all.
    let mut ready = Vec::with_capacity(fds.len());
    let mut errors = 0u64;
    let mut next_stats = sys::now() + o.stats_interval_ns;
    let mut write_stats = |ab: &Link, ba: &Link, errors: u64, kind: &'static str| {
        if let Some(w) = stats_out.as_mut() {
            let line = StatsLine {
                kind,
                ts: sys::unix_time().as_secs_f64(),
                ab: ab.stats(),
                ba: ba.stats(),
                send_errors: errors,
            };
            let _ = serde_json::to_writer(&mut *w, &line);
            let _ = w.write_all(b"\n");
            let _ = w.flush();
        }
    };
    while !sys::stop_requested() {
        pump_in(&mut pa, &mut ab)?;
        pump_in(&mut pb, &mut ba)?;
        let now = sys::now();
        pump_out(&mut ab, &pb.sock, &mut pa.pool, now, &mut errors);
        pump_out(&mut ba, &pa.sock, &mut pb.pool, now, &mut errors);
        if now >= next_stats {
            write_stats(&ab, &ba, errors, "stats");
            next_stats = now + o.stats_interval_ns;
        }
        let deadline = [ab.poll_timeout(), ba.poll_timeout(), Some(next_stats)]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(next_stats);
        let now = sys::now();
        if deadline <= now {
            continue;
        }
        let wait = deadline - now;
        if wait <= o.spin_ns {
            continue;
        }
        // Wake a little early and spin the rest: a sleeping thread is woken
        // tens of microseconds late; the delay must not carry that jitter.
        sys::poll_readable(&fds, Some((wait - o.spin_ns).min(100_000_000)), &mut ready)?;
    }
    write_stats(&ab, &ba, errors, "exit");
    eprintln!(
        "ka-linkem: stopped; a->b delivered {} lost {} dropped {}; b->a delivered {} lost {} dropped {}",
        ab.stats().delivered, ab.stats().lost, ab.stats().dropped,
        ba.stats().delivered, ba.stats().lost, ba.stats().dropped
    );
    Ok(())
}
