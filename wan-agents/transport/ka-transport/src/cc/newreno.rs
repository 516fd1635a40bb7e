//! NewReno's window arithmetic (RFC 5681, RFC 6582's ssthresh): the paper's
//! TCP failover (III-A). Loss recovery itself (which segment to resend, how
//! fast the window comes down during recovery) is the connection's SACK
//! recovery with PRR, as in Linux's `reno` module; RFC 6582's partial-ACK
//! rules exist for TCP without SACK and are not needed here.

use ka_core::Nanos;

use super::{fq_pacing_rate, AckSample, CongestionSignal, Controller};
use crate::rtt::RttEstimator;

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

    pub fn cwnd(&self) -> u64 {
        self.cwnd
    }

    /// RFC 5681 eq. (4): max(FlightSize / 2, 2 SMSS).
    fn halved(&self, flight_size: u64) -> u64 {
        (flight_size / 2).max(2 * self.smss)
    }
}

impl Controller for NewReno {
    fn name(&self) -> &'static str {
        "newreno"
    }

    /// RFC 5681 (3.1): slow start adds min(N, SMSS) per ACK (eq. 2),
    /// congestion avoidance SMSS*SMSS/cwnd per ACK (eq. 3, at least 1 byte).
    fn on_ack(&mut self, _now: Nanos, ack: &AckSample, _rtt: &RttEstimator) {
        if ack.delivered == 0 {
            return;
        }
        if self.cwnd < self.ssthresh {
            self.cwnd += ack.delivered.min(self.smss);
        } else {
            self.cwnd += (self.smss * self.smss / self.cwnd).max(1);
        }
    }

    fn on_congestion_event(&mut self, _now: Nanos, signal: CongestionSignal, flight_size: u64) {
        self.ssthresh = self.halved(flight_size);
        if signal == CongestionSignal::Ecn {
            // RFC 3168 6.1.2: halve at once, nothing was lost.
            self.cwnd = self.ssthresh;
        }
    }

    fn on_recovery_end(&mut self, _now: Nanos) {
        self.cwnd = self.ssthresh.max(self.smss);
    }

    /// RFC 5681 (3.1): ssthresh = max(FlightSize/2, 2 SMSS) on the first
    /// timeout of a segment (held on later ones), cwnd = loss window = 1 SMSS.
    fn on_rto(&mut self, _now: Nanos, flight_size: u64, first_expiry: bool) {
        if first_expiry {
            self.ssthresh = self.halved(flight_size);
        }
        self.cwnd = self.smss;
    }

    fn seed(&mut self, _now: Nanos, cwnd: u64, ssthresh: u64) {
        self.cwnd = cwnd.max(self.smss);
        self.ssthresh = ssthresh.max(2 * self.smss);
    }

    fn window(&self) -> u64 {
        self.cwnd
    }

    fn pacing_rate(&self, rtt: &RttEstimator) -> Option<f64> {
        fq_pacing_rate(
            self.cwnd,
            self.in_slow_start(),
            rtt,
            self.smss,
            self.datagram_len,
        )
    }

    fn in_slow_start(&self) -> bool {
        self.cwnd < self.ssthresh
    }

    fn ssthresh(&self) -> Option<u64> {
        Some(self.ssthresh)
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

    fn acked(delivered: u64) -> AckSample {
        AckSample {
            delivered,
            ..AckSample::default()
        }
    }

    #[test]
    fn slow_start_then_congestion_avoidance() {
        let r = rtt(100);
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        nr.on_ack(0, &acked(3000), &r);
        assert_eq!(nr.cwnd(), 4380 + SMSS, "at most SMSS per ACK (eq. 2)");
        nr.seed(0, 10 * SMSS, 10 * SMSS);
        assert!(!nr.in_slow_start());
        nr.on_ack(0, &acked(SMSS), &r);
        assert_eq!(nr.cwnd(), 10 * SMSS + SMSS / 10, "SMSS*SMSS/cwnd (eq. 3)");
    }

    #[test]
    fn loss_sets_ssthresh_and_recovery_end_the_window() {
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        nr.seed(0, 20 * SMSS, u64::MAX);
        nr.on_congestion_event(0, CongestionSignal::Loss, 20 * SMSS);
        assert_eq!(nr.ssthresh(), Some(10 * SMSS));
        assert_eq!(
            nr.cwnd(),
            20 * SMSS,
            "PRR brings the window down, not the event"
        );
        nr.on_recovery_end(0);
        assert_eq!(nr.cwnd(), 10 * SMSS);
        // Tiny flight: the floor of 2 SMSS.
        nr.on_congestion_event(0, CongestionSignal::Loss, SMSS);
        assert_eq!(nr.ssthresh(), Some(2 * SMSS));
    }

    #[test]
    fn rto_and_ecn() {
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        nr.seed(0, 30 * SMSS, u64::MAX);
        nr.on_rto(0, 30 * SMSS, true);
        assert_eq!((nr.cwnd(), nr.ssthresh()), (SMSS, Some(15 * SMSS)));
        // A second expiry of the same segment keeps ssthresh.
        nr.on_rto(0, SMSS, false);
        assert_eq!((nr.cwnd(), nr.ssthresh()), (SMSS, Some(15 * SMSS)));
        nr.seed(0, 16 * SMSS, u64::MAX);
        nr.on_congestion_event(0, CongestionSignal::Ecn, 16 * SMSS);
        assert_eq!((nr.cwnd(), nr.ssthresh()), (8 * SMSS, Some(8 * SMSS)));
    }

    #[test]
    fn pacing_rate_like_fq() {
        let r = rtt(100);
        let mut nr = NewReno::new(SMSS, 1500, 4380);
        assert!(nr.in_slow_start());
        nr.seed(0, 100 * SMSS, u64::MAX);
        // 144000 B per 100 ms = 1.44e6 payload B/s, 1.5e6 IP B/s, x2.
        let p = nr.pacing_rate(&r).expect("srtt known");
        assert!((p - 3.0e6).abs() < 1.0, "{p}");
    }
}
