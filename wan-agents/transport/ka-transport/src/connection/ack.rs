//! What comes back from the receiver: HANDSHAKE_ACK, ACK (SACK, the rate
//! echo, ECN), FIN_ACK and RESET. Every datagram is validated before it
//! changes anything.

use ka_core::Nanos;

use super::recovery::Delivered;
use super::{Connection, ConnectionError, DatagramError, Event, State};
use crate::cc::{AckSample, CongestionSignal};
use crate::record::{Mode, SwitchReason};
use crate::wire::{self, Ack, HandshakeAck, Kind, Repr, Status};

impl Connection {
    pub(super) fn process(&mut self, now: Nanos, bytes: &[u8]) -> Result<(), DatagramError> {
        let repr = Repr::parse_bytes(bytes).map_err(DatagramError::Malformed)?;
        if repr.flow_id() != self.flow_id {
            return Err(DatagramError::WrongFlow {
                expected: self.flow_id,
                got: repr.flow_id(),
            });
        }
        if self.state == State::Closed {
            return Err(DatagramError::Closed);
        }
        match repr {
            Repr::HandshakeAck(h) => self.on_handshake_ack(now, &h),
            Repr::Ack(a) => match self.state {
                State::Established => self.on_ack(now, &a),
                // Late ACKs after completion: harmless.
                State::Closing => Ok(()),
                _ => Err(DatagramError::UnexpectedKind(Kind::Ack)),
            },
            Repr::FinAck(f) => {
                if self.state == State::Closing && f.final_size == self.size {
                    self.close();
                    Ok(())
                } else {
                    Err(DatagramError::UnexpectedKind(Kind::FinAck))
                }
            }
            Repr::Reset(rs) => self.on_reset(now, &rs),
            other => Err(DatagramError::UnexpectedKind(other.kind())),
        }
    }

    /// The receiver has no flow for us. Believed only when it echoes a
    /// datagram we sent and is not yet acknowledged (or our FIN), so a
    /// forger must have seen our traffic.
    fn on_reset(&mut self, now: Nanos, rs: &wire::Reset) -> Result<(), DatagramError> {
        self.check_ts_echo(now, rs.ts_echo)?;
        match self.state {
            State::Established if self.board.contains(rs.seq_echo) => {
                self.fail(ConnectionError::Reset);
                Ok(())
            }
            // Every byte was acknowledged; the receiver forgot the flow
            // before our FIN: nothing is lost, stop repeating it.
            State::Closing if rs.seq_echo == self.size => {
                self.close();
                Ok(())
            }
            _ => Err(DatagramError::UnexpectedKind(Kind::Reset)),
        }
    }

    fn check_ts_echo(&self, now: Nanos, ts: u64) -> Result<(), DatagramError> {
        if ts < self.created_at || ts > now {
            Err(DatagramError::BadTimestampEcho)
        } else {
            Ok(())
        }
    }

    fn on_handshake_ack(&mut self, now: Nanos, h: &HandshakeAck) -> Result<(), DatagramError> {
        if self.state != State::Handshake {
            // A duplicate (our retransmitted HANDSHAKE was answered twice).
            return Ok(());
        }
        self.check_ts_echo(now, h.ts_echo)?;
        let negotiated = self.kickass && h.kickass;
        let rate = if negotiated {
            h.rate_echo
                .validate()
                .map_err(|_| DatagramError::BogusRateEcho)?
        } else {
            None
        };
        if h.status != Status::Accepted {
            self.fail(ConnectionError::Refused(h.status));
            return Ok(());
        }
        self.rtt.on_sample(now - h.ts_echo);
        self.state = State::Established;
        self.hs_deadline = None;
        self.hs_due = false;
        if self.kickass && !negotiated {
            self.kickass = false;
            self.switch_mode(now, Mode::Tcp, SwitchReason::NotNegotiated);
        }
        if let Some(r) = rate {
            self.on_rate(now, r);
        }
        self.update_pacer(now);
        self.events.push_back(Event::Connected {
            kickass: self.kickass,
            advertised_rate: rate,
        });
        Ok(())
    }

    fn validate_ack(&self, now: Nanos, ack: &Ack) -> Result<Option<f64>, DatagramError> {
        if ack.cum_ack > self.snd_nxt {
            return Err(DatagramError::AckBeyondSent {
                acked: ack.cum_ack,
                sent: self.snd_nxt,
            });
        }
        if let Some(&(_, end)) = ack.sack.as_slice().iter().find(|b| b.1 > self.snd_nxt) {
            return Err(DatagramError::AckBeyondSent {
                acked: end,
                sent: self.snd_nxt,
            });
        }
        self.check_ts_echo(now, ack.ts_echo)?;
        if self.kickass {
            ack.rate_echo
                .validate()
                .map_err(|_| DatagramError::BogusRateEcho)
        } else {
            Ok(None)
        }
    }

    fn on_ack(&mut self, now: Nanos, ack: &Ack) -> Result<(), DatagramError> {
        let rate = self.validate_ack(now, ack)?;
        if self.first_data_ack_at.is_none() {
            self.first_data_ack_at = Some(now);
        }
        if ack.cum_ack < self.snd_una {
            // Reordered ACK: its SACKs and rate still count, nothing else.
            self.stats.stale_acks += 1;
        }
        let mut delivered = self.board.mark_sacked(&ack.sack, self.snd_una);
        let newly_sacked = delivered.bytes;
        let newly_acked = ack.cum_ack.saturating_sub(self.snd_una);
        if newly_acked > 0 {
            delivered.merge(self.board.advance_una(ack.cum_ack));
            self.snd_una = ack.cum_ack;
            self.consecutive_rtos = 0;
            self.dupacks = 0;
        } else if ack.cum_ack == self.snd_una && self.snd_una < self.snd_nxt && newly_sacked > 0 {
            self.stats.duplicate_acks += 1;
            self.dupacks += 1;
        }
        let rtt_sample = (delivered.bytes > 0).then(|| now - ack.ts_echo);
        if let Some(s) = rtt_sample {
            self.rtt.on_sample(s);
        }
        self.rack.on_delivered(now, &delivered, self.rtt.min_rtt());
        if let Some(r) = rate {
            self.on_rate(now, r);
        }
        self.on_tlp_ack(now, ack);
        self.detect_losses(now);
        self.grow_or_recover(now, ack, &delivered, newly_acked > 0, rtt_sample);
        if ack.ece {
            self.on_ecn_echo(now, ack.cum_ack);
        }
        if rate.is_some() {
            self.maybe_return_to_kickass(now);
        }
        self.check_no_rate(now);

        if newly_acked > 0 {
            // RFC 6298 (5.2, 5.3).
            self.rto_deadline = if self.snd_una >= self.snd_nxt {
                None
            } else {
                Some(now + self.rtt.rto())
            };
        }
        if self.snd_una >= self.size && self.completed_at.is_none() {
            self.complete(now);
            return Ok(());
        }
        self.arm_tlp(now);
        self.update_pacer(now);
        Ok(())
    }

    /// Outside recovery the controller in force grows its window, on
    /// in-order delivery only (RFC 5681; Linux `tcp_may_raise_cwnd`): what
    /// an ACK SACKed counts then, but SACKs alone do not grow it. In
    /// recovery PRR decides what may leave, and the episode ends once
    /// everything up to the recovery point is acknowledged.
    fn grow_or_recover(
        &mut self,
        now: Nanos,
        ack: &Ack,
        delivered: &Delivered,
        in_order: bool,
        rtt_sample: Option<Nanos>,
    ) {
        if let Some(rec) = &self.recovery {
            if ack.cum_ack >= rec.recover {
                self.recovery = None;
                self.tcp.on_recovery_end(now);
            }
        }
        let pipe = self.board.flight();
        let ssthresh = self.ssthresh();
        if let Some(rec) = &mut self.recovery {
            rec.on_ack(delivered.bytes, pipe, ssthresh, super::SMSS);
            return;
        }
        if !in_order || delivered.bytes == 0 {
            return;
        }
        let sample = AckSample {
            delivered: delivered.bytes,
            rtt: rtt_sample,
            cum_ack: ack.cum_ack,
            snd_nxt: self.snd_nxt,
        };
        let rtt = self.rtt.clone();
        if ack.cum_ack >= self.loss_recover {
            self.controller_mut().on_ack(now, &sample, &rtt);
        } else {
            // Repairing after a timeout: TCP mode slow-starts towards ssthresh.
            self.tcp.on_ack(now, &sample, &rtt);
        }
    }

    /// An ECN-echo: Kick-Ass mode ends (II-C3), TCP mode reduces once per
    /// window (RFC 3168 6.1.2).
    fn on_ecn_echo(&mut self, now: Nanos, cum_ack: u64) {
        self.stats.ecn_echoes += 1;
        self.enter_tcp_mode(now, SwitchReason::Ecn);
        if self.recovery.is_none() && cum_ack >= self.ecn_recover {
            self.ecn_recover = self.snd_nxt;
            let flight = self.board.flight();
            self.tcp
                .on_congestion_event(now, CongestionSignal::Ecn, flight);
        }
    }

    /// RFC 8985 7.4: the ACK that covers the probe ends its episode. A
    /// probe that resent old data and was itself what filled the hole (the
    /// ACK echoes the probe's timestamp) repaired a real loss: reduce as
    /// for one. If the original arrived (an earlier timestamp), the probe
    /// was spurious and nothing changes.
    fn on_tlp_ack(&mut self, now: Nanos, ack: &Ack) {
        let Some(end) = self.tlp.end_seq else {
            return;
        };
        if ack.cum_ack < end {
            return;
        }
        let repaired = self.tlp.retransmission && ack.ts_echo >= self.tlp.sent_at;
        self.tlp.end_seq = None;
        if repaired && self.recovery.is_none() {
            self.enter_tcp_mode(now, SwitchReason::Loss);
            let flight = self.board.flight();
            self.tcp
                .on_congestion_event(now, CongestionSignal::Loss, flight);
            self.tcp.on_recovery_end(now);
        }
    }
}
