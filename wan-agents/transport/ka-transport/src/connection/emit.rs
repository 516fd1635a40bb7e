//! What leaves: the handshake, data segments (new, retransmitted, the tail
//! loss probe), the endpoint's RTT indicator when this flow carries it,
//! and the FIN. Every data byte passes the window (or PRR's allowance in
//! recovery) and the pacer, the indicator included.

use ka_core::encoding;
use ka_core::Nanos;

use super::{Connection, State, Transmit, SMSS};
use crate::wire::{
    rtt_indicator_payload_len, Data, Fin, Handshake, Kind, Repr, RttIndicator, DATA_HEADER_LEN,
    FULL_UDP_PAYLOAD_LEN, HANDSHAKE_HEADER_LEN, IP_UDP_OVERHEAD, MIN_HANDSHAKE_LEN,
};

/// IP bytes of a DATA datagram carrying `len` payload bytes.
fn data_ip_len(len: u64) -> usize {
    len as usize + DATA_HEADER_LEN + IP_UDP_OVERHEAD
}

impl Connection {
    /// The next data to send: the lowest lost segment (RFC 6675 NextSeg
    /// rule 1), else new data.
    pub(super) fn next_data(&self) -> Option<(u64, u64)> {
        if let Some(l) = self.board.next_lost() {
            return Some(l);
        }
        (self.snd_nxt < self.size).then(|| (self.snd_nxt, SMSS.min(self.size - self.snd_nxt)))
    }

    /// The window (outside recovery) or PRR (in it) lets `len` more bytes out.
    pub(super) fn window_allows(&self, len: u64) -> bool {
        match &self.recovery {
            Some(rec) => rec.allows(),
            None => self.board.flight() + len <= self.window(),
        }
    }

    /// The pacer holds a datagram of `len` payload bytes back.
    pub(super) fn paced_out(&self, now: Nanos, len: u64) -> bool {
        self.pacer.delay(now, data_ip_len(len)).is_some()
    }

    pub(super) fn send_handshake(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Transmit {
        if self.start.is_none() {
            self.start = Some(now);
            self.mode_since = now;
        }
        self.hs_due = false;
        self.hs_attempts += 1;
        let backoff = 1u64 << (self.hs_attempts - 1).min(16);
        self.hs_deadline = Some(
            now + self
                .cfg
                .initial_rto
                .saturating_mul(backoff)
                .min(self.cfg.max_rto),
        );
        let padded = self.handshake_mode == crate::record::HandshakeMode::Padded;
        let datagram_len = if padded {
            FULL_UDP_PAYLOAD_LEN
        } else {
            MIN_HANDSHAKE_LEN.max(HANDSHAKE_HEADER_LEN + self.token.len())
        };
        Repr::Handshake(Handshake {
            flow_id: self.flow_id,
            flow_size: self.size,
            timestamp: now,
            kickass: self.kickass,
            padded,
            token: &self.token,
            datagram_len,
        })
        .emit_into(buf);
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            rtt_indicator: false,
            dont_fragment: !self.kickass,
            kind: Kind::Handshake,
        }
    }

    /// Send `len` bytes at `seq`: new data at `snd_nxt` (any length up to
    /// SMSS), or a segment sent before (its own length).
    pub(super) fn send_segment(
        &mut self,
        now: Nanos,
        seq: u64,
        len: u64,
        buf: &mut Vec<u8>,
    ) -> Transmit {
        let retransmission = self.board.on_sent(now, seq, len);
        let len = if retransmission {
            self.retransmissions += 1;
            let len = self.board.get(seq).map_or(len, |s| s.len);
            self.retransmitted_bytes += len;
            len
        } else {
            self.snd_nxt = seq + len;
            len
        };
        if let Some(rec) = &mut self.recovery {
            rec.on_sent(len);
        }
        self.scratch.clear();
        self.scratch.resize(len as usize, 0);
        self.payload.fill(self.flow_id, seq, &mut self.scratch);
        Repr::Data(Data {
            flow_id: self.flow_id,
            seq,
            timestamp: now,
            retransmission,
            payload: &self.scratch,
        })
        .emit_into(buf);
        self.pacer.on_sent(now, buf.len() + IP_UDP_OVERHEAD);
        if self.rto_deadline.is_none() {
            // RFC 6298 (5.1).
            self.rto_deadline = Some(now + self.rtt.rto());
        }
        if !retransmission {
            self.arm_tlp(now);
        }
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            rtt_indicator: false,
            dont_fragment: !self.may_be_cut(now),
            kind: Kind::Data,
        }
    }

    /// Whether this data segment leaves with DF clear, for a router to cut
    /// (paper II-C: "endpoints clear DF on data packets"). In Kick-Ass mode
    /// every one; in TCP mode one per SRTT, enough to keep reading rates
    /// (II-C3), while the rest leave whole: at a legacy bottleneck a cut
    /// datagram is two packets, two places in a packet-counted queue (half
    /// the share TCP gets beside it: 0.67 in experiment (b)) and two small
    /// ones that slip into a nearly full byte-counted one (1.96).
    fn may_be_cut(&mut self, now: Nanos) -> bool {
        if !self.kickass {
            return false;
        }
        if self.mode == crate::record::Mode::KickAss {
            return true;
        }
        let every = self.rtt.srtt().unwrap_or(0);
        if self
            .rate_probe_at
            .is_none_or(|t| now >= t.saturating_add(every))
        {
            self.rate_probe_at = Some(now);
            return true;
        }
        false
    }

    /// RFC 8985 7.3: one new segment if there is one (past the window and
    /// the pacer), else the highest segment the receiver lacks; the
    /// retransmission timer restarts.
    pub(super) fn send_tail_loss_probe(
        &mut self,
        now: Nanos,
        buf: &mut Vec<u8>,
    ) -> Option<Transmit> {
        self.tlp.due = false;
        let (seq, len, retransmission) = if self.snd_nxt < self.size {
            (self.snd_nxt, SMSS.min(self.size - self.snd_nxt), false)
        } else {
            let seq = self.board.highest_unsacked()?;
            (seq, self.board.get(seq)?.len, true)
        };
        self.stats.tail_loss_probes += 1;
        let t = self.send_segment(now, seq, len, buf);
        self.tlp.end_seq = Some(self.snd_nxt);
        self.tlp.retransmission = retransmission;
        self.tlp.sent_at = now;
        self.tlp.deadline = None;
        self.rto_deadline = Some(now + self.rtt.rto());
        Some(t)
    }

    /// Whether this flow can carry the endpoint's RTT indicator: Kick-Ass
    /// negotiated, established, with an RTT to encode.
    pub fn can_carry_rtt_indicator(&self) -> bool {
        self.state == State::Established && self.kickass && self.rtt.srtt().is_some()
    }

    /// When this flow could carry a due RTT indicator (its pacer lets the
    /// indicator's bytes out); `None` if it cannot carry one.
    pub fn rtt_indicator_ready_at(&self) -> Option<Nanos> {
        if !self.can_carry_rtt_indicator() {
            return None;
        }
        let ip_len = encoding::rtt_indicator(self.rtt.srtt_ms()?);
        Some(self.pacer.ready_at(ip_len).unwrap_or(self.last_now))
    }

    /// The endpoint's RTT indicator, carried by this flow (paper II-B:
    /// "Every 100 ms, the endpoint sends a packet of an indicator size with
    /// the Do-Not-Fragment bit set"). Where new data may leave now, the
    /// indicator *is* that data, cut to the indicator's length, so it costs
    /// no extra bytes; otherwise a standalone indicator leaves when the
    /// pacer allows its bytes. `None`: not now (paced, or this flow cannot
    /// carry it): the caller offers it to another flow or asks again.
    pub fn poll_rtt_indicator(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Option<Transmit> {
        self.last_now = self.last_now.max(now);
        if !self.can_carry_rtt_indicator() {
            return None;
        }
        let srtt_ms = self.rtt.srtt_ms()?;
        let ip_len = encoding::rtt_indicator(srtt_ms);
        let data_len = (ip_len - IP_UDP_OVERHEAD - DATA_HEADER_LEN) as u64;
        let new_data_due = self.recovery.is_none()
            && self.board.lost_is_empty()
            && !self.tlp.due
            && self.snd_nxt + data_len <= self.size;
        let mut t = if new_data_due && self.window_allows(data_len) {
            if self.paced_out(now, data_len) {
                return None;
            }
            self.send_segment(now, self.snd_nxt, data_len, buf)
        } else {
            if self.pacer.delay(now, ip_len).is_some() {
                return None;
            }
            Repr::RttIndicator(RttIndicator {
                flow_id: self.flow_id,
                datagram_len: rtt_indicator_payload_len(srtt_ms),
            })
            .emit_into(buf);
            self.pacer.on_sent(now, ip_len);
            self.datagrams_sent += 1;
            Transmit {
                len: buf.len(),
                rtt_indicator: true,
                dont_fragment: true,
                kind: Kind::RttIndicator,
            }
        };
        debug_assert_eq!(t.ip_len(), ip_len);
        t.rtt_indicator = true;
        t.dont_fragment = true;
        self.rtt_indicators_sent += 1;
        Some(t)
    }

    pub(super) fn send_fin(&mut self, now: Nanos, buf: &mut Vec<u8>) -> Transmit {
        self.fin_due = false;
        self.fin_attempts += 1;
        self.fin_deadline = Some(now + self.rtt.base_rto());
        Repr::Fin(Fin {
            flow_id: self.flow_id,
            final_size: self.size,
            timestamp: now,
        })
        .emit_into(buf);
        self.datagrams_sent += 1;
        Transmit {
            len: buf.len(),
            rtt_indicator: false,
            dont_fragment: true,
            kind: Kind::Fin,
        }
    }
}
