//! One direction of the userspace link emulator (`ka-linkem`), sans IO.
//!
//! Same pipeline as mahimahi's shells: random loss at arrival, then a
//! drop-tail queue served at the link rate, then a constant one-way delay.
//! Departure and release times are computed from the virtual clock, not
//! from when the shell happened to poll, so a late wake-up does not add
//! delay jitter to later packets: the only error is the wake-up lateness of
//! the packet being released.

use std::collections::VecDeque;

use crate::rng::SplitMix64;
use crate::units::Limit;
use crate::Nanos;

/// Upper bound on packets held in the delay line of an unrated link (the
/// queue limit bounds the rated part), so memory stays bounded whatever
/// arrives: 1 Gbit/s of 1500-byte packets for 1.2 s.
pub const MAX_IN_FLIGHT: usize = 100_000;

#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct LinkConfig {
    pub delay_ns: Nanos,
    /// Probability in [0, 1] that a packet is lost on arrival.
    pub loss: f64,
    /// `None`: no rate limit (delay and loss only).
    pub rate_bps: Option<f64>,
    pub queue: Limit,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LinkStats {
    pub arrived: u64,
    pub lost: u64,
    pub dropped: u64,
    pub delivered: u64,
    pub delivered_bytes: u64,
    /// How late frames left against their due time (the emulator's own
    /// timing error: wake-up latency), worst case and count above 1 ms.
    pub late_max_ns: u64,
    pub late_total_ns: u64,
    pub late_over_1ms: u64,
}

/// A packet waiting to be serialised: it finishes at `departure`.
struct Queued {
    packet: Vec<u8>,
    departure: f64,
    len: usize,
}

pub struct Link {
    cfg: LinkConfig,
    rng: SplitMix64,
    /// Serialisation finish time of the last accepted packet (virtual clock).
    last_departure: f64,
    ns_per_byte: f64,
    /// Accepted, not yet serialised.
    queue: VecDeque<Queued>,
    queue_bytes: usize,
    /// Serialised, waiting out the propagation delay, in release order.
    delay_line: VecDeque<(Nanos, Vec<u8>, usize)>,
    stats: LinkStats,
}

impl Link {
    pub fn new(cfg: LinkConfig, seed: u64) -> Self {
        let ns_per_byte = cfg.rate_bps.map_or(0.0, |r| 8e9 / r);
        Link {
            cfg,
            rng: SplitMix64::new(seed),
            last_departure: 0.0,
            ns_per_byte,
            queue: VecDeque::new(),
            queue_bytes: 0,
            delay_line: VecDeque::new(),
            stats: LinkStats::default(),
        }
    }

    pub fn stats(&self) -> &LinkStats {
        &self.stats
    }

    pub fn config(&self) -> &LinkConfig {
        &self.cfg
    }

    /// A frame arrived at `now`; `len` is what it costs on the link (the
    /// buffer may carry a shell's metadata too). `Err` hands the buffer
    /// back (lost/dropped).
    pub fn on_packet(&mut self, now: Nanos, packet: Vec<u8>, len: usize) -> Result<(), Vec<u8>> {
        self.stats.arrived += 1;
        if self.cfg.loss > 0.0 && self.rng.next_f64() < self.cfg.loss {
            self.stats.lost += 1;
            return Err(packet);
        }
        self.advance(now);
        if self.cfg.rate_bps.is_none() {
            if self.delay_line.len() >= MAX_IN_FLIGHT {
                self.stats.dropped += 1;
                return Err(packet);
            }
            self.delay_line
                .push_back((now + self.cfg.delay_ns, packet, len));
            return Ok(());
        }
        let fits = match self.cfg.queue {
            Limit::Packets(n) => self.queue.len() < n,
            Limit::Bytes(b) => self.queue_bytes + len <= b,
        };
        if !fits {
            self.stats.dropped += 1;
            return Err(packet);
        }
        let start = self.last_departure.max(now as f64);
        let departure = start + len as f64 * self.ns_per_byte;
        self.last_departure = departure;
        self.queue_bytes += len;
        self.queue.push_back(Queued {
            packet,
            departure,
            len,
        });
        Ok(())
    }

    /// Move everything serialised by `now` into the delay line.
    fn advance(&mut self, now: Nanos) {
        while self
            .queue
            .front()
            .is_some_and(|q| q.departure <= now as f64)
        {
            let Some(q) = self.queue.pop_front() else {
                break;
            };
            self.queue_bytes -= q.len;
            let release = q.departure.ceil() as Nanos + self.cfg.delay_ns;
            self.delay_line.push_back((release, q.packet, q.len));
        }
    }

    /// The next frame due for delivery at `now`.
    pub fn poll_transmit(&mut self, now: Nanos) -> Option<Vec<u8>> {
        self.advance(now);
        if self.delay_line.front().is_some_and(|(t, _, _)| *t <= now) {
            let (due, p, len) = self.delay_line.pop_front()?;
            let late = now - due;
            self.stats.late_max_ns = self.stats.late_max_ns.max(late);
            self.stats.late_total_ns += late;
            if late > 1_000_000 {
                self.stats.late_over_1ms += 1;
            }
            self.stats.delivered += 1;
            self.stats.delivered_bytes += len as u64;
            return Some(p);
        }
        None
    }

    /// When the next frame is due, if any.
    pub fn poll_timeout(&self) -> Option<Nanos> {
        let d = self.delay_line.front().map(|(t, _, _)| *t);
        let q = self
            .queue
            .front()
            .map(|q| q.departure.ceil() as Nanos + self.cfg.delay_ns);
        match (d, q) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn queue_packets(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Nanos = 1_000_000;

    fn run(link: &mut Link, arrivals: &[(Nanos, usize)], late: Nanos) -> Vec<(Nanos, usize)> {
        let mut out = Vec::new();
        let mut i = 0;
        let mut now = 0;
        loop {
            while i < arrivals.len() && arrivals[i].0 <= now {
                let _ = link.on_packet(now, vec![0; arrivals[i].1], arrivals[i].1);
                i += 1;
            }
            while let Some(p) = link.poll_transmit(now) {
                out.push((now, p.len()));
            }
            let next_arrival = arrivals.get(i).map(|a| a.0);
            let next = match (link.poll_timeout().map(|t| t + late), next_arrival) {
                (Some(a), Some(b)) => a.min(b),
                (a, b) => match a.or(b) {
                    Some(t) => t,
                    None => return out,
                },
            };
            now = next.max(now + 1);
        }
    }

    #[test]
    fn constant_delay_without_rate() {
        let cfg = LinkConfig {
            delay_ns: 50 * MS,
            loss: 0.0,
            rate_bps: None,
            queue: Limit::Packets(10),
        };
        let mut l = Link::new(cfg, 1);
        let arrivals: Vec<(Nanos, usize)> = (0..100).map(|i| (i * 100_000, 100)).collect();
        let out = run(&mut l, &arrivals, 0);
        assert_eq!(out.len(), 100);
        for (a, o) in arrivals.iter().zip(&out) {
            assert_eq!(o.0 - a.0, 50 * MS);
        }
    }

    #[test]
    fn rate_queue_then_delay() {
        // 12 Mbit/s: 1500 bytes per ms; 5 packets at once, queue of 3.
        let cfg = LinkConfig {
            delay_ns: 10 * MS,
            loss: 0.0,
            rate_bps: Some(12e6),
            queue: Limit::Packets(3),
        };
        let mut l = Link::new(cfg, 1);
        let arrivals: Vec<(Nanos, usize)> = (0..5).map(|_| (0, 1500)).collect();
        let out = run(&mut l, &arrivals, 0);
        assert_eq!(
            out.iter().map(|o| o.0).collect::<Vec<_>>(),
            vec![11 * MS, 12 * MS, 13 * MS]
        );
        assert_eq!(l.stats().dropped, 2);
    }

    #[test]
    fn late_wakeups_do_not_accumulate() {
        let cfg = LinkConfig {
            delay_ns: 5 * MS,
            loss: 0.0,
            rate_bps: Some(12e6),
            queue: Limit::Packets(1000),
        };
        let mut l = Link::new(cfg, 1);
        let arrivals: Vec<(Nanos, usize)> = (0..1000).map(|_| (0, 1500)).collect();
        let out = run(&mut l, &arrivals, 300_000);
        // The k-th packet is due at (k+1) ms + 5 ms; each is at most 300 us late.
        for (k, o) in out.iter().enumerate() {
            let due = (k as u64 + 1) * MS + 5 * MS;
            assert!(o.0 >= due && o.0 <= due + 300_000, "{k}: {} vs {due}", o.0);
        }
    }

    #[test]
    fn loss_rate_is_as_configured() {
        let cfg = LinkConfig {
            delay_ns: 0,
            loss: 0.1,
            rate_bps: None,
            queue: Limit::Packets(10),
        };
        let mut l = Link::new(cfg, 42);
        let n = 100_000;
        for i in 0..n {
            let _ = l.on_packet(i, vec![0; 64], 64);
        }
        let p = l.stats().lost as f64 / n as f64;
        // 0.1 +- 5 sigma (sigma ~ 0.00095).
        assert!((p - 0.1).abs() < 0.005, "{p}");
    }
}
