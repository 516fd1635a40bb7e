//! Congestion control behind one small trait, as in quinn-proto: the
//! connection does loss detection and sequence bookkeeping, a
//! [`Controller`] only turns events into a window and a pacing rate.
//!
//! Two controllers, one per endpoint mode of the paper (II-C):
//! * [`ExplicitRate`]: Kick-Ass mode. Pace at the advertised rate, window
//!   = rate x SRTT (paper IV-A: "both the pacing delay and the congestion
//!   window are updated with the arrival of new rate information").
//! * [`NewReno`]: TCP mode, the paper's failover (III-A: "For TCP failover
//!   mode, we use TCP NewReno"), and the pure baseline. RFC 5681 slow start
//!   and congestion avoidance, RFC 6582 fast recovery, RFC 5681/6298 RTO.
//!
//! Windows and flight sizes are in payload bytes (as TCP's cwnd counts
//! SMSS-sized segments); pacing rates are in IP bytes per second, because
//! that is what a router measures and advertises.

use core::fmt;

use ka_core::Nanos;

use crate::rtt::RttEstimator;

/// A fast-recovery ACK, classified by the connection (RFC 6582 section 3.2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecoveryAck {
    /// Another duplicate ACK while in fast recovery (step 4: inflate).
    Duplicate,
    /// New data acknowledged but not everything up to `recover` (step 5).
    Partial { acked: u64 },
    /// Everything up to `recover` acknowledged: recovery ends (step 3
    /// "full acknowledgment"). `flight_size` is what is outstanding now.
    Full { flight_size: u64 },
}

/// A congestion signal that is not a timeout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CongestionSignal {
    /// The third duplicate ACK: fast retransmit, enter fast recovery.
    DuplicateAcks,
    /// An ECN-echo (RFC 3168 6.1.2): reduce once, retransmit nothing.
    Ecn,
}

/// Window and pacing from ACK and loss events.
pub trait Controller: fmt::Debug {
    /// `acked` new bytes cumulatively acknowledged outside fast recovery.
    fn on_ack(&mut self, now: Nanos, acked: u64, rtt: &RttEstimator);
    /// An ACK during fast recovery.
    fn on_recovery_ack(&mut self, now: Nanos, ack: RecoveryAck);
    /// A loss or ECN signal; `flight_size` is the data outstanding.
    fn on_congestion_event(&mut self, now: Nanos, signal: CongestionSignal, flight_size: u64);
    /// The retransmission timer expired. `first_expiry` is false when the
    /// segment had already been retransmitted by the timer (RFC 5681 keeps
    /// ssthresh then).
    fn on_rto(&mut self, now: Nanos, flight_size: u64, first_expiry: bool);
    /// Bytes that may be outstanding.
    fn window(&self) -> u64;
    /// IP bytes per second to pace at; `None` = send as the window allows.
    fn pacing_rate(&self, rtt: &RttEstimator) -> Option<f64>;
    fn in_slow_start(&self) -> bool;
    /// Slow-start threshold, where the controller has one.
    fn ssthresh(&self) -> Option<u64>;
}

/// Payload bytes per second carried by an advertised rate of
/// `rate_bytes_per_ms` IP bytes per ms, when every datagram of
/// `datagram_len` IP bytes carries `smss` payload bytes.
pub fn payload_rate(rate_bytes_per_ms: f64, smss: u64, datagram_len: u64) -> f64 {
    rate_bytes_per_ms * 1000.0 * smss as f64 / datagram_len as f64
}

/// RFC 5681 (3.1) initial window: min(4 SMSS, max(2 SMSS, 4380 bytes)).
pub fn rfc5681_initial_window(smss: u64) -> u64 {
    (4 * smss).min((2 * smss).max(4380))
}

/// TCP NewReno: RFC 5681 + RFC 6582 (the `recover` variable and the
/// partial-ACK rules live in the connection, which owns sequence numbers;
/// the window arithmetic lives here).
#[derive(Debug, Clone)]
pub struct NewReno {
    smss: u64,
    datagram_len: u64,
    cwnd: u64,
    ssthresh: u64,
}

impl NewReno {
    /// `datagram_len`: IP bytes of a full segment, for pacing.
    pub fn new(smss: u64, datagram_len: u64, initial_window: u64) -> Self {
        NewReno {
            smss,
            datagram_len,
            cwnd: initial_window.max(smss),
            // RFC 5681: "arbitrarily high" initially.
            ssthresh: u64::MAX,
        }
    }

    /// Take over a window from Kick-Ass mode (see the connection's
    /// `enter_tcp_mode` for the choice of values).
    pub fn seed(&mut self, cwnd: u64, ssthresh: u64) {
        self.cwnd = cwnd.max(self.smss);
        self.ssthresh = ssthresh.max(2 * self.smss);
    }

    pub fn cwnd(&self) -> u64 {
        self.cwnd
    }

    pub fn smss(&self) -> u64 {
        self.smss
    }

    /// RFC 5681 eq. (4) / RFC 6582: max(FlightSize / 2, 2 SMSS).
    fn halved(&self, flight_size: u64) -> u64 {
        (flight_size / 2).max(2 * self.smss)
    }
}

impl Controller for NewReno {
    /// RFC 5681 (3.1): slow start adds min(N, SMSS) per ACK (eq. 2),
    /// congestion avoidance SMSS*SMSS/cwnd per ACK (eq. 3, at least 1 byte).
    fn on_ack(&mut self, _now: Nanos, acked: u64, _rtt: &RttEstimator) {
        if acked == 0 {
            return;
        }
        if self.cwnd < self.ssthresh {
            self.cwnd += acked.min(self.smss);
        } else {
            self.cwnd += (self.smss * self.smss / self.cwnd).max(1);
        }
    }

    fn on_recovery_ack(&mut self, _now: Nanos, ack: RecoveryAck) {
        match ack {
            // RFC 6582 step 4 (RFC 5681 3.2 step 4): inflate by SMSS for
            // the segment that left the network.
            RecoveryAck::Duplicate => self.cwnd += self.smss,
            // RFC 6582 step 5: deflate by the newly acknowledged data, add
            // back SMSS if at least SMSS was acknowledged.
            RecoveryAck::Partial { acked } => {
                self.cwnd = self.cwnd.saturating_sub(acked);
                if acked >= self.smss {
                    self.cwnd += self.smss;
                }
                self.cwnd = self.cwnd.max(self.smss);
            }
            // RFC 6582 step 3, option (1): min(ssthresh, max(FlightSize,
            // SMSS) + SMSS), which avoids a burst when little is in flight.
            RecoveryAck::Full { flight_size } => {
                self.cwnd = self.ssthresh.min(flight_size.max(self.smss) + self.smss);
            }
        }
    }

    fn on_congestion_event(&mut self, _now: Nanos, signal: CongestionSignal, flight_size: u64) {
        self.ssthresh = self.halved(flight_size);
        self.cwnd = match signal {
            // RFC 6582 step 2 / RFC 5681 3.2 steps 2-3.
            CongestionSignal::DuplicateAcks => self.ssthresh + 3 * self.smss,
            // RFC 3168 6.1.2: halve, no inflation (nothing was lost).
            CongestionSignal::Ecn => self.ssthresh,
        };
    }

    /// RFC 5681 (3.1): ssthresh = max(FlightSize/2, 2 SMSS) on the first
    /// timeout of a segment (held on later ones), cwnd = loss window = 1 SMSS.
    fn on_rto(&mut self, _now: Nanos, flight_size: u64, first_expiry: bool) {
        if first_expiry {
            self.ssthresh = self.halved(flight_size);
        }
        self.cwnd = self.smss;
    }

    fn window(&self) -> u64 {
        self.cwnd
    }

    /// Paced like Linux with `fq`: 2x cwnd/SRTT in slow start, 1.2x after
    /// (`tcp_pacing_ss_ratio`, `tcp_pacing_ca_ratio`), so pacing smooths
    /// bursts without ever being what limits TCP mode.
    fn pacing_rate(&self, rtt: &RttEstimator) -> Option<f64> {
        let srtt = rtt.srtt()?;
        let gain = if self.in_slow_start() { 2.0 } else { 1.2 };
        let payload_per_s = self.cwnd as f64 / (srtt as f64 / 1e9);
        Some(gain * payload_per_s * self.datagram_len as f64 / self.smss as f64)
    }

    fn in_slow_start(&self) -> bool {
        self.cwnd < self.ssthresh
    }

    fn ssthresh(&self) -> Option<u64> {
        Some(self.ssthresh)
    }
}

/// Kick-Ass mode: the router's advertised rate is the sending rate.
///
/// Before the first rate arrives (the paper's handshake, where "the sender
/// sends packets as it would in a normal TCP connection", II) the window
/// starts at the initial window and grows as slow start does, so a path
/// without a Kick-Ass router costs nothing while the endpoint waits one RTT
/// for a rate that never comes.
#[derive(Debug, Clone)]
pub struct ExplicitRate {
    smss: u64,
    datagram_len: u64,
    /// Advertised rate in IP bytes per ms (the paper's unit).
    rate: Option<f64>,
    srtt: Option<Nanos>,
    startup_window: u64,
}

impl ExplicitRate {
    pub fn new(smss: u64, datagram_len: u64, initial_window: u64) -> Self {
        ExplicitRate {
            smss,
            datagram_len,
            rate: None,
            srtt: None,
            startup_window: initial_window.max(smss),
        }
    }

    /// Follow a newly advertised rate (bytes/ms).
    pub fn set_rate(&mut self, rate_bytes_per_ms: f64, rtt: &RttEstimator) {
        self.rate = Some(rate_bytes_per_ms);
        self.srtt = rtt.srtt().or(self.srtt);
    }

    pub fn rate(&self) -> Option<f64> {
        self.rate
    }

    /// rate x SRTT in payload bytes (no headroom, rounded up): the window
    /// Kick-Ass mode is actually using, which TCP mode takes over. Rounded
    /// up so that cwnd/SRTT of a NewReno seeded with it is not below the
    /// rate (the return test of II-C3 then passes at once at the same rate).
    pub fn bdp(&self) -> Option<u64> {
        let (rate, srtt) = (self.rate?, self.srtt?);
        Some((payload_rate(rate, self.smss, self.datagram_len) * srtt as f64 / 1e9).ceil() as u64)
    }
}

impl Controller for ExplicitRate {
    fn on_ack(&mut self, _now: Nanos, acked: u64, rtt: &RttEstimator) {
        self.srtt = rtt.srtt().or(self.srtt);
        if self.rate.is_none() {
            self.startup_window += acked.min(self.smss);
        }
    }

    // The connection leaves Kick-Ass mode before any of these can matter
    // (paper II-C3: a loss signal means TCP mode), so they are no-ops.
    fn on_recovery_ack(&mut self, _now: Nanos, _ack: RecoveryAck) {}

    fn on_congestion_event(&mut self, _now: Nanos, _signal: CongestionSignal, _flight: u64) {}

    fn on_rto(&mut self, _now: Nanos, _flight_size: u64, _first_expiry: bool) {}

    /// rate x SRTT plus two segments, so the pacer's burst and the ACK
    /// clock's granularity never make the window, rather than the rate,
    /// the limit.
    fn window(&self) -> u64 {
        match self.bdp() {
            Some(bdp) => bdp + 2 * self.smss,
            None => self.startup_window,
        }
    }

    fn pacing_rate(&self, _rtt: &RttEstimator) -> Option<f64> {
        self.rate.map(|r| r * 1000.0)
    }

    fn in_slow_start(&self) -> bool {
        self.rate.is_none()
    }

    fn ssthresh(&self) -> Option<u64> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rtt::{INITIAL_RTO, LINUX_MIN_RTO, MAX_RTO};

    const SMSS: u64 = 1440;

    fn rtt(ms: u64) -> RttEstimator {
        let mut r = RttEstimator::new(LINUX_MIN_RTO, INITIAL_RTO, MAX_RTO);
        r.on_sample(ms * 1_000_000);
        r
    }

    #[test]
    fn initial_window_rfc5681() {
        // SMSS 1440: 4380 bytes; SMSS 536: 4 * 536; SMSS 2500: 2 * 2500.
        assert_eq!(rfc5681_initial_window(1440), 4380);
        assert_eq!(rfc5681_initial_window(536), 2144);
        assert_eq!(rfc5681_initial_window(2500), 5000);
    }

    #[test]
    fn slow_start_then_congestion_avoidance() {
        let r = rtt(100);
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        nr.on_ack(0, 3000, &r);
        assert_eq!(nr.cwnd(), 4380 + SMSS, "at most SMSS per ACK (eq. 2)");
        nr.seed(10 * SMSS, 10 * SMSS);
        assert!(!nr.in_slow_start());
        nr.on_ack(0, SMSS, &r);
        assert_eq!(nr.cwnd(), 10 * SMSS + SMSS / 10, "SMSS*SMSS/cwnd (eq. 3)");
    }

    #[test]
    fn fast_recovery_arithmetic_rfc6582() {
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        nr.seed(20 * SMSS, u64::MAX);
        nr.on_congestion_event(0, CongestionSignal::DuplicateAcks, 20 * SMSS);
        assert_eq!(nr.ssthresh(), Some(10 * SMSS));
        assert_eq!(nr.cwnd(), 13 * SMSS);
        nr.on_recovery_ack(0, RecoveryAck::Duplicate);
        assert_eq!(nr.cwnd(), 14 * SMSS);
        nr.on_recovery_ack(0, RecoveryAck::Partial { acked: 3 * SMSS });
        assert_eq!(nr.cwnd(), 12 * SMSS);
        nr.on_recovery_ack(0, RecoveryAck::Partial { acked: 100 });
        assert_eq!(nr.cwnd(), 12 * SMSS - 100);
        nr.on_recovery_ack(
            0,
            RecoveryAck::Full {
                flight_size: 15 * SMSS,
            },
        );
        assert_eq!(nr.cwnd(), 10 * SMSS, "min(ssthresh, ...)");
        nr.seed(20 * SMSS, 10 * SMSS);
        nr.on_recovery_ack(
            0,
            RecoveryAck::Full {
                flight_size: 2 * SMSS,
            },
        );
        assert_eq!(nr.cwnd(), 3 * SMSS, "max(FlightSize, SMSS) + SMSS");
        // Tiny flight: the floor of 2 SMSS.
        nr.on_congestion_event(0, CongestionSignal::DuplicateAcks, SMSS);
        assert_eq!(nr.ssthresh(), Some(2 * SMSS));
        assert_eq!(nr.cwnd(), 5 * SMSS);
    }

    #[test]
    fn rto_and_ecn() {
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        nr.seed(30 * SMSS, u64::MAX);
        nr.on_rto(0, 30 * SMSS, true);
        assert_eq!((nr.cwnd(), nr.ssthresh()), (SMSS, Some(15 * SMSS)));
        // A second expiry of the same segment keeps ssthresh.
        nr.on_rto(0, SMSS, false);
        assert_eq!((nr.cwnd(), nr.ssthresh()), (SMSS, Some(15 * SMSS)));
        nr.seed(16 * SMSS, u64::MAX);
        nr.on_congestion_event(0, CongestionSignal::Ecn, 16 * SMSS);
        assert_eq!((nr.cwnd(), nr.ssthresh()), (8 * SMSS, Some(8 * SMSS)));
    }

    #[test]
    fn explicit_rate_window_and_pacing() {
        let r = rtt(100);
        let mut ka = ExplicitRate::new(SMSS, 1500, 4380);
        assert_eq!(ka.window(), 4380);
        assert_eq!(ka.pacing_rate(&r), None);
        ka.on_ack(0, SMSS, &r);
        assert_eq!(ka.window(), 4380 + SMSS, "slow start until a rate arrives");
        // 1250 B/ms (10 Mbit/s) of IP bytes = 1.2e6 payload bytes/s;
        // over 100 ms that is 120000 bytes.
        ka.set_rate(1250.0, &r);
        assert_eq!(ka.bdp(), Some(120_000));
        ka.set_rate(1191.958196024979, &r);
        assert_eq!(ka.bdp(), Some(114_428));
        ka.set_rate(1250.0, &r);
        assert_eq!(ka.window(), 120_000 + 2 * SMSS);
        assert_eq!(ka.pacing_rate(&r), Some(1.25e6));
        assert!(!ka.in_slow_start());
    }

    #[test]
    fn newreno_pacing_rate() {
        let r = rtt(100);
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        assert!(nr.in_slow_start());
        nr.seed(100 * SMSS, u64::MAX);
        // 144000 B per 100 ms = 1.44e6 payload B/s, 1.5e6 IP B/s, x2.
        let p = nr.pacing_rate(&r).expect("srtt known");
        assert!((p - 3.0e6).abs() < 1.0, "{p}");
    }
}
