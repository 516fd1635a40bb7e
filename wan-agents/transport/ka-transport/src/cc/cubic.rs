//! CUBIC, RFC 9438, with HyStart as Linux's `tcp_cubic` does it: the TCP
//! our Kick-Ass endpoints fall back to by default, so that TCP mode is as
//! good as the kernel CUBIC the trials compare against (paper II-C2: the
//! performance of Kick-Ass "is bounded below by TCP").
//!
//! Windows are kept in segments (f64) as the RFC writes them; the trait
//! speaks bytes.

use ka_core::Nanos;

use super::{fq_pacing_rate, AckSample, CongestionSignal, Controller};
use crate::rtt::RttEstimator;

/// RFC 9438 4.2: C, in segments per second cubed.
pub const C_CUBIC: f64 = 0.4;
/// RFC 9438 4.6: multiplicative decrease factor.
pub const BETA_CUBIC: f64 = 0.7;
/// RFC 9438 4.3: the Reno-friendly additive increase, 3 (1 - beta) / (1 + beta).
const ALPHA_CUBIC: f64 = 3.0 * (1.0 - BETA_CUBIC) / (1.0 + BETA_CUBIC);

/// Linux `tcp_cubic`'s HyStart (the version since 5.7): leave slow start
/// when an RTT round's ACK train has lasted a minimum RTT (ACK-train
/// detection) or when the round's RTT rose by clamp(minRTT / 8, 4 ms,
/// 16 ms) over the minimum (delay detection), once cwnd reaches 16 segments.
#[derive(Debug, Clone)]
pub struct HyStart {
    found: bool,
    round_start: Nanos,
    last_ack: Nanos,
    end_seq: u64,
    curr_rtt: Nanos,
    sample_cnt: u32,
    delay_min: Option<Nanos>,
    /// The sender paces (Linux: `sk_pacing_status` set).
    paced: bool,
}

impl HyStart {
    /// `hystart_low_window`.
    pub const LOW_WINDOW: f64 = 16.0;
    /// `hystart_ack_delta_us`: ACKs closer than this form a train.
    pub const ACK_DELTA: Nanos = 2_000_000;
    /// `HYSTART_MIN_SAMPLES`.
    pub const MIN_SAMPLES: u32 = 8;
    pub const DELAY_MIN: Nanos = 4_000_000;
    pub const DELAY_MAX: Nanos = 16_000_000;

    fn new(paced: bool) -> Self {
        HyStart {
            found: false,
            round_start: 0,
            last_ack: 0,
            end_seq: 0,
            curr_rtt: Nanos::MAX,
            sample_cnt: 0,
            delay_min: None,
            paced,
        }
    }

    fn reset_round(&mut self, now: Nanos, snd_nxt: u64) {
        self.round_start = now;
        self.last_ack = now;
        self.end_seq = snd_nxt;
        self.curr_rtt = Nanos::MAX;
        self.sample_cnt = 0;
    }

    /// One ACK in slow start; true when slow start should end here. The
    /// train threshold is half the minimum RTT, the whole of it when TCP
    /// mode is paced (as Linux: a paced train is spread over RTT/2).
    fn on_ack(&mut self, now: Nanos, ack: &AckSample, cwnd_segments: f64) -> bool {
        if let Some(rtt) = ack.rtt {
            let rtt = rtt.max(1);
            self.delay_min = Some(self.delay_min.map_or(rtt, |d| d.min(rtt)));
        }
        if self.found || cwnd_segments < Self::LOW_WINDOW {
            return false;
        }
        if ack.cum_ack > self.end_seq {
            self.reset_round(now, ack.snd_nxt);
        }
        let Some(delay_min) = self.delay_min else {
            return false;
        };
        if now.saturating_sub(self.last_ack) <= Self::ACK_DELTA {
            self.last_ack = now;
            let threshold = if self.paced { delay_min } else { delay_min / 2 };
            if now.saturating_sub(self.round_start) > threshold {
                self.found = true;
            }
        }
        if let Some(rtt) = ack.rtt {
            self.curr_rtt = self.curr_rtt.min(rtt);
            if self.sample_cnt < Self::MIN_SAMPLES {
                self.sample_cnt += 1;
            } else {
                let thresh = (delay_min / 8).clamp(Self::DELAY_MIN, Self::DELAY_MAX);
                if self.curr_rtt > delay_min + thresh {
                    self.found = true;
                }
            }
        }
        self.found
    }

    pub fn found(&self) -> bool {
        self.found
    }
}

#[derive(Debug, Clone)]
pub struct Cubic {
    smss: u64,
    datagram_len: u64,
    /// Segments.
    cwnd: f64,
    ssthresh: f64,
    /// W_max: the window before the last reduction (after fast convergence).
    w_max: f64,
    /// cwnd_prior: the window before the last reduction.
    cwnd_prior: f64,
    /// W_est, the Reno-friendly estimate.
    w_est: f64,
    k: f64,
    epoch_start: Option<Nanos>,
    hystart: HyStart,
}

impl Cubic {
    pub fn new(smss: u64, datagram_len: u64, initial_window: u64) -> Self {
        Cubic {
            smss,
            datagram_len,
            cwnd: (initial_window.max(smss) as f64 / smss as f64).max(1.0),
            ssthresh: f64::INFINITY,
            w_max: 0.0,
            cwnd_prior: 0.0,
            w_est: 0.0,
            k: 0.0,
            epoch_start: None,
            hystart: HyStart::new(false),
        }
    }

    /// The sender paces TCP mode: HyStart's ACK train threshold is then the
    /// whole minimum RTT (Linux: with `sk_pacing_status` set).
    pub fn paced(mut self, paced: bool) -> Self {
        self.hystart.paced = paced;
        self
    }

    pub fn w_max_segments(&self) -> f64 {
        self.w_max
    }

    pub fn cwnd_segments(&self) -> f64 {
        self.cwnd
    }

    pub fn k_seconds(&self) -> f64 {
        self.k
    }

    pub fn hystart(&self) -> &HyStart {
        &self.hystart
    }

    /// W_cubic(t), RFC 9438 eq. 1, `t` seconds into the epoch.
    pub fn w_cubic(&self, t: f64) -> f64 {
        C_CUBIC * (t - self.k).powi(3) + self.w_max
    }

    fn start_epoch(&mut self, now: Nanos) {
        self.epoch_start = Some(now);
        // RFC 9438 4.2 eq. 2 (cwnd_epoch = cwnd): at or above W_max the
        // curve starts on its plateau.
        self.k = if self.cwnd < self.w_max {
            ((self.w_max - self.cwnd) / C_CUBIC).cbrt()
        } else {
            0.0
        };
        if self.cwnd > self.w_max {
            self.w_max = self.cwnd;
        }
        self.w_est = self.cwnd;
    }

    /// Congestion avoidance, RFC 9438 4.2-4.4, for `segments` acknowledged.
    fn congestion_avoidance(&mut self, now: Nanos, segments: f64, rtt: &RttEstimator) {
        if self.epoch_start.is_none() {
            self.start_epoch(now);
        }
        let epoch = self.epoch_start.unwrap_or(now);
        let t = now.saturating_sub(epoch) as f64 / 1e9;
        // RFC 9438 aims one RTT ahead with the smoothed RTT; Linux's
        // tcp_cubic with the minimum (`delay_min`). With a standing queue the
        // smoothed RTT runs ahead of the curve: the kernel's choice, as it is
        // the TCP our flows share links with.
        let ahead = rtt.min_rtt().or(rtt.srtt()).map_or(0.0, |s| s as f64 / 1e9);
        let target = self.w_cubic(t + ahead).clamp(self.cwnd, 1.5 * self.cwnd);
        // RFC 9438 4.3 says alpha SHOULD become 1 once W_est reaches
        // cwnd_prior; Linux's tcp_cubic (`tcp_friendliness`) keeps 0.53, and
        // the TCP we share links with and compare against is Linux's: with 1
        // our flows took 1.4x the kernel CUBIC flows' share beside them
        // (experiment (a) in namespaces, the Reno-friendly region governing).
        self.w_est += ALPHA_CUBIC * segments / self.cwnd;
        if self.w_cubic(t) < self.w_est {
            // The Reno-friendly region (4.3).
            self.cwnd = self.cwnd.max(self.w_est);
        } else {
            // Concave and convex regions (4.4, 4.5).
            self.cwnd += (target - self.cwnd) / self.cwnd * segments;
        }
    }

    fn reduce(&mut self) {
        self.epoch_start = None;
        self.cwnd_prior = self.cwnd;
        // Fast convergence (4.7).
        self.w_max = if self.cwnd < self.w_max {
            self.cwnd * (1.0 + BETA_CUBIC) / 2.0
        } else {
            self.cwnd
        };
        self.ssthresh = (self.cwnd * BETA_CUBIC).max(2.0);
    }

    fn bytes(&self, segments: f64) -> u64 {
        if segments.is_infinite() {
            u64::MAX
        } else {
            (segments * self.smss as f64).round() as u64
        }
    }
}

impl Controller for Cubic {
    fn name(&self) -> &'static str {
        "cubic"
    }

    fn on_ack(&mut self, now: Nanos, ack: &AckSample, rtt: &RttEstimator) {
        if ack.delivered == 0 {
            return;
        }
        let mut segments = ack.delivered as f64 / self.smss as f64;
        if self.cwnd < self.ssthresh {
            if self.hystart.on_ack(now, ack, self.cwnd) {
                self.ssthresh = self.cwnd;
            }
            // RFC 5681 slow start, up to ssthresh; what is left grows the
            // window in congestion avoidance (Linux `tcp_slow_start`).
            let room = (self.ssthresh - self.cwnd).max(0.0);
            let step = segments.min(room);
            self.cwnd += step;
            segments -= step;
            if segments <= 0.0 {
                return;
            }
        }
        self.congestion_avoidance(now, segments, rtt);
    }

    fn on_congestion_event(&mut self, _now: Nanos, signal: CongestionSignal, _flight_size: u64) {
        self.reduce();
        if signal == CongestionSignal::Ecn {
            self.cwnd = self.ssthresh;
        }
    }

    fn on_recovery_end(&mut self, _now: Nanos) {
        self.cwnd = self.ssthresh.max(1.0);
    }

    /// RFC 9438 4.8 / Linux: ssthresh as for a loss on the first expiry,
    /// cwnd one segment, and the curve forgotten (`bictcp_reset` on
    /// TCP_CA_Loss): slow start back to ssthresh, then a fresh epoch.
    fn on_rto(&mut self, _now: Nanos, _flight_size: u64, first_expiry: bool) {
        if first_expiry {
            self.reduce();
        }
        self.w_max = 0.0;
        self.epoch_start = None;
        self.cwnd = 1.0;
        self.hystart = HyStart::new(self.hystart.paced);
    }

    /// From Kick-Ass mode: the curve is put where it would be had CUBIC
    /// itself brought the window to `cwnd` and found its limit there
    /// (W_max = cwnd, the epoch now, K as after a reduction from it), so a
    /// no-rate entry continues from rate x SRTT, holds it while K lasts and
    /// only then probes above it. The router's rate was the fair share a
    /// moment ago: probing at once (K = 0) took 1.2-1.5x the kernel CUBIC
    /// flows' share beside them (experiment (a) in namespaces).
    fn seed(&mut self, now: Nanos, cwnd: u64, ssthresh: u64) {
        self.cwnd = (cwnd.max(self.smss) as f64 / self.smss as f64).max(1.0);
        self.ssthresh = if ssthresh == u64::MAX {
            f64::INFINITY
        } else {
            (ssthresh as f64 / self.smss as f64).max(2.0)
        };
        self.w_max = self.cwnd;
        self.cwnd_prior = self.cwnd;
        self.k = (self.w_max * (1.0 - BETA_CUBIC) / C_CUBIC).cbrt();
        self.epoch_start = Some(now);
        self.w_est = self.cwnd;
    }

    fn window(&self) -> u64 {
        self.bytes(self.cwnd).max(self.smss)
    }

    fn pacing_rate(&self, rtt: &RttEstimator) -> Option<f64> {
        fq_pacing_rate(
            self.window(),
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
        Some(self.bytes(self.ssthresh))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rtt::{INITIAL_RTO, LINUX_MIN_RTO, MAX_RTO};

    const SMSS: u64 = 1440;
    const MS: Nanos = 1_000_000;

    fn rtt(ms: u64) -> RttEstimator {
        let mut r = RttEstimator::new(LINUX_MIN_RTO, INITIAL_RTO, MAX_RTO);
        r.on_sample(ms * MS);
        r
    }

    fn seg_ack(rtt_ms: u64) -> AckSample {
        AckSample {
            delivered: SMSS,
            rtt: Some(rtt_ms * MS),
            cum_ack: 0,
            snd_nxt: 0,
        }
    }

    /// RFC 9438's curve after a loss at W = 100 segments: cwnd drops to
    /// beta W = 70, K = cbrt((100 - 70) / 0.4) = 4.217 s, and the window
    /// follows W_cubic(t) = 0.4 (t - K)^3 + 100: concave up to W_max at K,
    /// convex after it.
    #[test]
    fn window_follows_the_cubic_curve_after_a_loss() {
        let r = rtt(100);
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        c.seed(0, 100 * SMSS, u64::MAX);
        c.on_congestion_event(0, CongestionSignal::Loss, 100 * SMSS);
        assert_eq!(c.ssthresh(), Some(70 * SMSS));
        c.on_recovery_end(0);
        assert_eq!(c.window(), 70 * SMSS);
        assert!((c.w_max_segments() - 100.0).abs() < 1e-9);
        // Feed one ACK per segment per RTT-sized slot, on simulated time.
        let mut now = 0;
        let mut at = Vec::new();
        while now < 10_000 * MS {
            let per_rtt = c.cwnd_segments().floor() as u64;
            for i in 0..per_rtt {
                c.on_ack(now + i * 100 * MS / per_rtt, &seg_ack(100), &r);
            }
            now += 100 * MS;
            at.push((now, c.cwnd_segments()));
        }
        let k = (30.0f64 / 0.4).cbrt();
        assert!((c.k_seconds() - k).abs() < 1e-9, "{}", c.k_seconds());
        let w = |t_s: f64| {
            at.iter()
                .find(|(n, _)| *n as f64 / 1e9 >= t_s)
                .map(|x| x.1)
                .unwrap()
        };
        // The target is W_cubic(t + RTT); allow one RTT of lag and the
        // per-ACK approximation.
        for t in [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0] {
            let expect = C_CUBIC * (t - k).powi(3) + 100.0;
            let got = w(t);
            assert!(
                (got - expect).abs() <= 0.05 * expect + 1.0,
                "t={t}: cwnd {got:.2}, W_cubic {expect:.2}"
            );
        }
        // Concave then flat near W_max then convex.
        assert!(w(3.0) - w(2.0) < w(2.0) - w(1.0));
        assert!((w(4.2) - 100.0).abs() < 2.0);
        assert!(w(7.0) - w(6.0) > w(6.0) - w(5.0));
    }

    #[test]
    fn fast_convergence_and_the_second_loss() {
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        c.seed(0, 100 * SMSS, u64::MAX);
        c.on_congestion_event(0, CongestionSignal::Loss, 0);
        c.on_recovery_end(0);
        // A loss below the last W_max: W_max = cwnd (1 + beta) / 2 (4.7).
        c.on_congestion_event(0, CongestionSignal::Loss, 0);
        assert!((c.w_max_segments() - 70.0 * 1.7 / 2.0).abs() < 1e-9);
        assert_eq!(c.ssthresh(), Some((49.0 * SMSS as f64).round() as u64));
    }

    #[test]
    fn reno_friendly_region_at_small_windows_and_short_rtt() {
        // At a small BDP the cubic curve grows slower than Reno would:
        // W_est (alpha 0.53 per RTT, as Linux keeps it) governs (4.3).
        let r = rtt(1);
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        c.seed(0, 10 * SMSS, u64::MAX);
        c.on_congestion_event(0, CongestionSignal::Loss, 0);
        c.on_recovery_end(0);
        let start = c.cwnd_segments();
        let mut now = 0;
        for _ in 0..100 {
            let per_rtt = c.cwnd_segments().floor() as u64;
            for _ in 0..per_rtt {
                c.on_ack(now, &seg_ack(1), &r);
            }
            now += MS;
        }
        // 100 RTTs of 1 ms: the cubic curve moved by 0.4 * 0.1^3 ~ 0; the
        // Reno-friendly estimate adds 0.53 segment per RTT.
        let grown = c.cwnd_segments() - start;
        assert!((grown - 53.0).abs() < 3.0, "grew {grown}");
    }

    #[test]
    fn seed_holds_the_curve_for_k_then_probes() {
        let r = rtt(100);
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        c.seed(0, 80 * SMSS, 80 * SMSS);
        assert!(!c.in_slow_start());
        assert_eq!(c.window(), 80 * SMSS);
        // K = cbrt(80 x 0.3 / 0.4) = 3.91 s: the curve is flat at 80 until then.
        assert!((c.k_seconds() - 60f64.cbrt()).abs() < 1e-9);
        assert!((c.w_cubic(3.5) - 80.0).abs() < 0.1);
        // One window of ACKs per 100 ms RTT: the Reno-friendly estimate
        // (0.53 segment per RTT, 4.3) is what grows the window meanwhile...
        let mut now = 0;
        let mut at = |c: &mut Cubic, until: Nanos| {
            while now < until {
                let per_rtt = c.cwnd_segments().floor() as u64;
                for i in 0..per_rtt {
                    c.on_ack(now + i * 100 * MS / per_rtt, &seg_ack(100), &r);
                }
                now += 100 * MS;
            }
            c.cwnd_segments()
        };
        let w3 = at(&mut c, 3_000 * MS);
        assert!((w3 - 96.0).abs() < 2.0, "{w3}");
        // ...and past K the cubic curve takes over (faster than Reno).
        let w8 = at(&mut c, 8_000 * MS);
        let w9 = at(&mut c, 9_000 * MS);
        assert!(w9 - w8 > 10.0, "{w8} -> {w9}");
        assert!(c.w_cubic(9.0) >= w8 - 1.0);
    }

    #[test]
    fn rto_restarts_from_one_segment() {
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        c.seed(0, 50 * SMSS, u64::MAX);
        c.on_rto(0, 50 * SMSS, true);
        assert_eq!(c.window(), SMSS);
        assert_eq!(c.ssthresh(), Some(35 * SMSS));
        assert!(c.in_slow_start());
        c.on_rto(0, SMSS, false);
        assert_eq!(c.ssthresh(), Some(35 * SMSS), "kept on a second expiry");
    }

    #[test]
    fn hystart_delay_detection_ends_slow_start() {
        let r = rtt(100);
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        let mut snd_nxt = 10 * SMSS;
        let mut cum = 0;
        let mut now = 0;
        // Rounds at a clean 100 ms, then the queue adds 20 ms.
        for round in 0..10 {
            let rtt_ms = if round < 3 { 100 } else { 120 };
            let per_round = c.cwnd_segments().floor() as u64;
            let end = snd_nxt;
            for i in 0..per_round {
                cum = (cum + SMSS).min(end);
                snd_nxt += 2 * SMSS;
                let ack = AckSample {
                    delivered: SMSS,
                    rtt: Some(rtt_ms * MS),
                    cum_ack: cum,
                    snd_nxt,
                };
                c.on_ack(now + i * 10 * MS, &ack, &r);
                if !c.in_slow_start() {
                    assert!(round >= 3, "left slow start before the delay rose");
                    assert!(c.hystart().found());
                    return;
                }
            }
            cum = end;
            now += rtt_ms * MS;
        }
        panic!("slow start never ended: cwnd {}", c.cwnd_segments());
    }

    #[test]
    fn hystart_waits_for_sixteen_segments() {
        let r = rtt(100);
        let mut c = Cubic::new(SMSS, 1500, 10 * SMSS);
        // Delay rises at once, but cwnd < 16: slow start goes on.
        for i in 0..5u64 {
            let ack = AckSample {
                delivered: SMSS,
                rtt: Some(if i == 0 { 100 * MS } else { 200 * MS }),
                cum_ack: i * SMSS,
                snd_nxt: 100 * SMSS,
            };
            c.on_ack(i * 30 * MS, &ack, &r);
        }
        assert!(c.in_slow_start());
        assert_eq!(c.window(), 15 * SMSS);
    }
}
