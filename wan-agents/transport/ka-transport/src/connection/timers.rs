//! Loss detection on time: RACK's reorder timer and loss marking, the tail
//! loss probe (RFC 8985), the retransmission timer (RFC 6298), the idle
//! timeout, and the start of a recovery episode.

use ka_core::Nanos;

use super::recovery::{Recovery, DUP_THRESH};
use super::{Connection, ConnectionError, State, Tlp};
use crate::cc::CongestionSignal;
use crate::record::SwitchReason;
use crate::rtt::CLOCK_GRANULARITY;

impl Connection {
    pub(super) fn on_established_timeout(&mut self, now: Nanos) {
        if now >= self.idle_deadline() {
            self.fail(ConnectionError::IdleTimeout);
            return;
        }
        if self.rto_deadline.is_some_and(|d| now >= d) {
            self.on_rto_expired(now);
        }
        if self.rack_deadline.is_some_and(|d| now >= d) {
            self.detect_losses(now);
            if let Some(rec) = &mut self.recovery {
                // Newly lost bytes left the pipe: PRR may send again.
                let (pipe, ssthresh) = (self.board.flight(), self.tcp.ssthresh().unwrap_or(0));
                rec.on_ack(0, pipe, ssthresh, super::SMSS);
            }
        }
        if self.tlp.deadline.is_some_and(|d| now >= d) {
            self.tlp.deadline = None;
            self.tlp.due = true;
        }
        self.check_no_rate(now);
    }

    /// RACK (RFC 8985 6.2 step 5) over the scoreboard; a first loss starts
    /// recovery.
    pub(super) fn detect_losses(&mut self, now: Nanos) {
        let reo_wnd = self.rack.reo_wnd(
            self.recovery.is_some(),
            self.board.sacked_segments(),
            self.rtt.min_rtt(),
            self.rtt.srtt(),
        );
        let (lost, timer) = self.board.rack_detect(now, &self.rack, reo_wnd);
        self.rack_deadline = timer;
        if lost > 0 && self.recovery.is_none() && self.snd_una >= self.loss_recover {
            self.enter_recovery(now);
        }
    }

    /// A loss: Kick-Ass mode ends (II-C3), the controller sets ssthresh,
    /// PRR takes over the window until everything sent so far is
    /// acknowledged (RFC 6675 RecoveryPoint).
    fn enter_recovery(&mut self, now: Nanos) {
        let reason = if self.dupacks >= DUP_THRESH {
            SwitchReason::DupAcks
        } else {
            SwitchReason::Loss
        };
        self.enter_tcp_mode(now, reason);
        self.stats.recoveries += 1;
        self.fast_retransmits += 1;
        let flight_before = self.snd_nxt - self.snd_una;
        self.tcp
            .on_congestion_event(now, CongestionSignal::Loss, flight_before);
        self.recovery = Some(Recovery::new(self.snd_nxt, flight_before));
        // The episode owns the tail now: no probe while it lasts.
        self.tlp = Tlp::default();
        self.update_pacer(now);
    }

    fn on_rto_expired(&mut self, now: Nanos) {
        self.rto_deadline = None;
        if self.snd_una >= self.snd_nxt {
            return;
        }
        self.consecutive_rtos += 1;
        self.rto_count += 1;
        if self.consecutive_rtos > self.cfg.max_consecutive_rtos {
            self.fail(ConnectionError::TooManyTimeouts);
            return;
        }
        self.enter_tcp_mode(now, SwitchReason::Rto);
        let flight = self.board.flight();
        let again = self.board.on_rto();
        self.tcp.on_rto(now, flight, !again);
        self.recovery = None;
        self.loss_recover = self.snd_nxt;
        self.dupacks = 0;
        self.tlp = Tlp::default();
        self.rack_deadline = None;
        self.rtt.on_timeout();
        self.update_pacer(now);
    }

    /// RFC 8985 7.2: arm the probe timeout, 2 SRTT after the last new data
    /// or ACK, while data is outstanding outside recovery and no probe is
    /// out; never later than the retransmission timer.
    pub(super) fn arm_tlp(&mut self, now: Nanos) {
        self.tlp.deadline = None;
        if self.state != State::Established
            || self.recovery.is_some()
            || self.snd_una < self.loss_recover
            || self.snd_una >= self.snd_nxt
            || self.tlp.end_seq.is_some()
            || self.tlp.due
        {
            return;
        }
        let Some(srtt) = self.rtt.srtt() else {
            return;
        };
        let at = now + 2 * srtt + CLOCK_GRANULARITY;
        if self.rto_deadline.is_none_or(|r| at < r) {
            self.tlp.deadline = Some(at);
        }
    }
}
