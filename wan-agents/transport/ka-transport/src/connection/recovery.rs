//! Loss detection and recovery, as Linux TCP does it with SACK: the
//! scoreboard (RFC 6675: what is SACKed, lost, in the pipe), RACK-TLP (RFC
//! 8985: a segment is lost once one sent after it was delivered and a
//! reordering window has passed; a tail loss probe when ACKs stop), and
//! Proportional Rate Reduction (RFC 6937: how many bytes may leave per ACK
//! while the window comes down to ssthresh). Several holes are repaired in
//! one RTT, and a lost retransmission is found by time, not by a timeout.
//!
//! Sequence numbers are byte offsets; a segment is keyed by its first byte.

use std::collections::{BTreeMap, BTreeSet};

use ka_core::Nanos;

use crate::wire::SackBlocks;

/// RFC 5681 (3.2) DupThresh.
pub const DUP_THRESH: u32 = 3;

#[derive(Debug, Clone)]
pub(super) struct Segment {
    pub len: u64,
    pub transmissions: u32,
    /// Reported held by the receiver (never reneged: our receiver keeps
    /// what it SACKs).
    pub sacked: bool,
    /// Declared lost, waiting in the retransmission queue.
    pub lost: bool,
    /// Counted in the pipe (RFC 6675's "pipe": sent, not SACKed, not lost,
    /// or retransmitted since it was lost).
    pub in_flight: bool,
    /// Time of the latest transmission (RACK's xmit_ts).
    pub xmit_ts: Nanos,
    /// Already resent once by the retransmission timer (RFC 5681: keep
    /// ssthresh on a second expiry).
    pub rto_retransmitted: bool,
}

/// What an ACK newly delivered, for RACK.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Delivered {
    pub bytes: u64,
    /// The most recently sent of the delivered segments: (xmit_ts, end,
    /// retransmitted).
    pub latest: Option<(Nanos, u64, bool)>,
    /// A never-retransmitted segment below the highest SACKed byte was
    /// delivered: the network reordered (RFC 8985 6.2 step 2).
    pub reordered: bool,
}

impl Delivered {
    fn note(&mut self, seg: &Segment, end: u64) {
        self.bytes += seg.len;
        let cand = (seg.xmit_ts, end, seg.transmissions > 1);
        if self
            .latest
            .is_none_or(|(t, e, _)| (cand.0, cand.1) > (t, e))
        {
            self.latest = Some(cand);
        }
    }

    pub fn merge(&mut self, o: Delivered) {
        self.bytes += o.bytes;
        self.reordered |= o.reordered;
        if let Some(c) = o.latest {
            if self.latest.is_none_or(|(t, e, _)| (c.0, c.1) > (t, e)) {
                self.latest = Some(c);
            }
        }
    }
}

/// The sender's view of every byte between snd_una and snd_nxt.
#[derive(Debug, Default)]
pub(super) struct Scoreboard {
    segments: BTreeMap<u64, Segment>,
    /// RFC 6675 pipe, payload bytes.
    flight: u64,
    /// Lost and not yet retransmitted, by sequence.
    lost: BTreeSet<u64>,
    sacked_segments: u64,
    /// End of the highest SACKed segment.
    high_sacked: u64,
}

impl Scoreboard {
    pub fn flight(&self) -> u64 {
        self.flight
    }

    pub fn lost_is_empty(&self) -> bool {
        self.lost.is_empty()
    }

    pub fn sacked_segments(&self) -> u64 {
        self.sacked_segments
    }

    pub fn contains(&self, seq: u64) -> bool {
        self.segments.contains_key(&seq)
    }

    pub fn get(&self, seq: u64) -> Option<&Segment> {
        self.segments.get(&seq)
    }

    /// The lowest lost segment waiting to be resent (RFC 6675 NextSeg rule 1).
    pub fn next_lost(&self) -> Option<(u64, u64)> {
        let &seq = self.lost.first()?;
        self.segments.get(&seq).map(|s| (seq, s.len))
    }

    /// The highest segment the receiver does not hold (the tail loss
    /// probe's retransmission, RFC 8985 7.3).
    pub fn highest_unsacked(&self) -> Option<u64> {
        self.segments
            .iter()
            .rev()
            .find(|(_, s)| !s.sacked)
            .map(|(&q, _)| q)
    }

    /// A segment left: new (`None` before) or sent again.
    pub fn on_sent(&mut self, now: Nanos, seq: u64, len: u64) -> bool {
        match self.segments.get_mut(&seq) {
            Some(seg) => {
                seg.transmissions += 1;
                seg.xmit_ts = now;
                seg.lost = false;
                if !seg.in_flight {
                    seg.in_flight = true;
                    self.flight += seg.len;
                }
                self.lost.remove(&seq);
                true
            }
            None => {
                self.segments.insert(
                    seq,
                    Segment {
                        len,
                        transmissions: 1,
                        sacked: false,
                        lost: false,
                        in_flight: true,
                        xmit_ts: now,
                        rto_retransmitted: false,
                    },
                );
                self.flight += len;
                false
            }
        }
    }

    fn remove_from_pipe(&mut self, seq: u64) {
        if let Some(seg) = self.segments.get_mut(&seq) {
            if seg.in_flight {
                seg.in_flight = false;
                self.flight -= seg.len;
            }
        }
    }

    /// Mark segments fully inside SACK blocks (above `una`).
    pub fn mark_sacked(&mut self, sack: &SackBlocks, una: u64) -> Delivered {
        let mut d = Delivered::default();
        for &(start, end) in sack.as_slice() {
            let start = start.max(una);
            if start >= end {
                continue;
            }
            // A segment that starts before `start` may still lie inside.
            let from = self
                .segments
                .range(..=start)
                .next_back()
                .map_or(start, |(&s, _)| s);
            let high = self.high_sacked;
            let mut newly = Vec::new();
            for (&seq, seg) in self.segments.range(from..end) {
                if seq >= start && seq + seg.len <= end && !seg.sacked {
                    newly.push(seq);
                }
            }
            for seq in newly {
                let seg = self.segments.get_mut(&seq).expect("listed");
                seg.sacked = true;
                let end = seq + seg.len;
                if end <= high && seg.transmissions == 1 {
                    d.reordered = true;
                }
                let copy = seg.clone();
                self.remove_from_pipe(seq);
                if copy.lost {
                    self.segments.get_mut(&seq).expect("listed").lost = false;
                    self.lost.remove(&seq);
                }
                self.sacked_segments += 1;
                self.high_sacked = self.high_sacked.max(end);
                d.note(&copy, end);
            }
        }
        d
    }

    /// Drop everything below the cumulative ACK `cum`.
    pub fn advance_una(&mut self, cum: u64) -> Delivered {
        let mut d = Delivered::default();
        while let Some((&seq, seg)) = self.segments.first_key_value() {
            if seq + seg.len > cum {
                break;
            }
            let seg = self.segments.remove(&seq).expect("first");
            if seg.in_flight {
                self.flight -= seg.len;
            }
            if seg.sacked {
                self.sacked_segments -= 1;
            } else {
                // A hole filled by its first transmission below what was
                // SACKed: reordering, not loss.
                if seq + seg.len <= self.high_sacked && seg.transmissions == 1 {
                    d.reordered = true;
                }
                d.note(&seg, seq + seg.len);
            }
            self.lost.remove(&seq);
        }
        d
    }

    /// RACK's loss marking (RFC 8985 6.2 step 5): every segment sent before
    /// the most recently delivered one is lost once `rack_rtt + reo_wnd`
    /// has passed since it left. Returns the newly lost bytes and, for what
    /// is not lost yet, the earliest time it will be (the reorder timer).
    pub fn rack_detect(&mut self, now: Nanos, rack: &Rack, reo_wnd: Nanos) -> (u64, Option<Nanos>) {
        let (Some(rtt), Some((r_ts, r_end))) = (rack.rtt, rack.latest) else {
            return (0, None);
        };
        let mut lost = Vec::new();
        let mut timer: Option<Nanos> = None;
        for (&seq, seg) in &self.segments {
            if seg.sacked || seg.lost {
                continue;
            }
            let end = seq + seg.len;
            let sent_before = seg.xmit_ts < r_ts || (seg.xmit_ts == r_ts && end < r_end);
            if !sent_before {
                continue;
            }
            let deadline = seg.xmit_ts.saturating_add(rtt).saturating_add(reo_wnd);
            if deadline <= now {
                lost.push(seq);
            } else {
                timer = Some(timer.map_or(deadline, |t| t.min(deadline)));
            }
        }
        let mut bytes = 0;
        for seq in lost {
            bytes += self.mark_lost(seq);
        }
        (bytes, timer)
    }

    fn mark_lost(&mut self, seq: u64) -> u64 {
        self.remove_from_pipe(seq);
        let seg = self.segments.get_mut(&seq).expect("exists");
        if seg.sacked || seg.lost {
            return 0;
        }
        seg.lost = true;
        self.lost.insert(seq);
        seg.len
    }

    /// The retransmission timer expired: everything outstanding that the
    /// receiver does not hold is presumed lost (go-back-N from snd_una,
    /// SACKed data kept). Returns whether the first segment had already
    /// been retransmitted by the timer.
    pub fn on_rto(&mut self) -> bool {
        let seqs: Vec<u64> = self.segments.keys().copied().collect();
        for seq in seqs {
            self.remove_from_pipe(seq);
            let seg = self.segments.get_mut(&seq).expect("listed");
            if !seg.sacked {
                seg.lost = true;
                self.lost.insert(seq);
            }
        }
        match self.segments.values_mut().next() {
            Some(seg) => {
                let again = seg.rto_retransmitted;
                seg.rto_retransmitted = true;
                again
            }
            None => false,
        }
    }
}

/// RACK's state (RFC 8985 6.1).
#[derive(Debug, Clone, Default)]
pub(super) struct Rack {
    /// RACK.rtt: RTT of the most recently sent delivered segment.
    pub rtt: Option<Nanos>,
    /// (RACK.xmit_ts, RACK.end_seq).
    pub latest: Option<(Nanos, u64)>,
    /// Reordering was ever seen on this flow.
    pub reordering_seen: bool,
}

impl Rack {
    /// RFC 8985 6.2 steps 1-2 for what one ACK delivered.
    pub fn on_delivered(&mut self, now: Nanos, d: &Delivered, min_rtt: Option<Nanos>) {
        if d.reordered {
            self.reordering_seen = true;
        }
        let Some((ts, end, retransmitted)) = d.latest else {
            return;
        };
        let rtt = now.saturating_sub(ts);
        // An ACK of the original may look like one of the retransmission:
        // a sample below the minimum RTT cannot be the retransmission's.
        if retransmitted && min_rtt.is_some_and(|m| rtt < m) {
            return;
        }
        if self.latest.is_none_or(|(t, e)| (ts, end) > (t, e)) {
            self.latest = Some((ts, end));
            self.rtt = Some(rtt);
        }
    }

    /// RACK.reo_wnd (RFC 8985 6.2 step 4, as Linux): zero while no
    /// reordering was seen and the flow is recovering or DupThresh
    /// segments are SACKed (the classic fast retransmit), else a quarter of
    /// the minimum RTT, never more than SRTT.
    pub fn reo_wnd(
        &self,
        recovering: bool,
        sacked_segments: u64,
        min_rtt: Option<Nanos>,
        srtt: Option<Nanos>,
    ) -> Nanos {
        if !self.reordering_seen && (recovering || sacked_segments >= DUP_THRESH as u64) {
            return 0;
        }
        let q = min_rtt.unwrap_or(0) / 4;
        srtt.map_or(q, |s| q.min(s))
    }
}

/// Proportional Rate Reduction (RFC 6937) for one recovery episode.
#[derive(Debug, Clone)]
pub(super) struct Recovery {
    /// RFC 6675 RecoveryPoint (exclusive end: snd_nxt at entry).
    pub recover: u64,
    recover_fs: u64,
    prr_delivered: u64,
    prr_out: u64,
    /// Bytes that may leave now (RFC 6937 sndcnt, less what left since).
    allowance: u64,
}

impl Recovery {
    pub fn new(recover: u64, recover_fs: u64) -> Self {
        Recovery {
            recover,
            recover_fs: recover_fs.max(1),
            prr_delivered: 0,
            prr_out: 0,
            allowance: 0,
        }
    }

    /// One ACK during recovery: `delivered` bytes newly acknowledged or
    /// SACKed, `pipe` after loss marking, `ssthresh` the target.
    pub fn on_ack(&mut self, delivered: u64, pipe: u64, ssthresh: u64, smss: u64) {
        self.prr_delivered += delivered;
        let sndcnt = if pipe > ssthresh {
            // Proportional part: ceil(prr_delivered * ssthresh / RecoverFS) - prr_out.
            let target = (self.prr_delivered as u128 * ssthresh as u128)
                .div_ceil(self.recover_fs as u128) as u64;
            target.saturating_sub(self.prr_out)
        } else {
            // PRR-SSRB: slow start back up to ssthresh, at most one segment
            // more than what was delivered.
            let limit = self
                .prr_delivered
                .saturating_sub(self.prr_out)
                .max(delivered)
                + smss;
            ssthresh.saturating_sub(pipe).min(limit)
        };
        // The fast retransmit always leaves (RFC 6937 and Linux).
        self.allowance = if self.prr_out == 0 {
            sndcnt.max(smss)
        } else {
            sndcnt
        };
    }

    /// RFC 6937 counts whole segments (sndcnt is rounded up): any
    /// allowance lets one segment out, and the overshoot is taken from the
    /// next ACK's share.
    pub fn allows(&self) -> bool {
        self.allowance > 0
    }

    pub fn on_sent(&mut self, len: u64) {
        self.prr_out += len;
        self.allowance = self.allowance.saturating_sub(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const U: u64 = 1000;

    fn board(n: u64) -> Scoreboard {
        let mut b = Scoreboard::default();
        for i in 0..n {
            b.on_sent(i, i * U, U);
        }
        b
    }

    fn sack(blocks: &[(u64, u64)]) -> SackBlocks {
        blocks.iter().copied().collect()
    }

    #[test]
    fn pipe_follows_sacks_losses_and_retransmissions() {
        let mut b = board(10);
        assert_eq!(b.flight(), 10 * U);
        let d = b.mark_sacked(&sack(&[(2 * U, 5 * U)]), 0);
        assert_eq!(d.bytes, 3 * U);
        assert_eq!(b.flight(), 7 * U);
        assert_eq!(b.sacked_segments(), 3);
        let mut rack = Rack::default();
        rack.on_delivered(10, &d, Some(1));
        // Segments 0 and 1 were sent before segment 4, delivered at t=10:
        // with reo_wnd 0 both are lost at once.
        let (lost, timer) = b.rack_detect(10, &rack, 0);
        assert_eq!((lost, timer), (2 * U, None));
        assert_eq!(b.flight(), 5 * U);
        assert_eq!(b.next_lost(), Some((0, U)));
        b.on_sent(20, 0, U);
        assert_eq!(b.flight(), 6 * U);
        assert_eq!(b.next_lost(), Some((U, U)));
        let d = b.advance_una(U);
        assert_eq!(d.bytes, U);
        assert_eq!(b.flight(), 5 * U);
    }

    #[test]
    fn rack_waits_for_the_reordering_window() {
        let mut b = board(4);
        let d = b.mark_sacked(&sack(&[(3 * U, 4 * U)]), 0);
        let mut rack = Rack::default();
        rack.on_delivered(100, &d, Some(50));
        assert_eq!(rack.rtt, Some(97));
        // 0, 1, 2 left at 0, 1, 2: lost at xmit + 97 + 25.
        let (lost, timer) = b.rack_detect(100, &rack, 25);
        assert_eq!((lost, timer), (0, Some(122)));
        let (lost, timer) = b.rack_detect(123, &rack, 25);
        assert_eq!((lost, timer), (2 * U, Some(124)));
        // A filled hole below the highest SACK without retransmission is
        // reordering, and reordering widens the window from then on.
        let d = b.advance_una(U);
        assert!(
            d.reordered,
            "segment 0 was marked lost, then arrived without a retransmission"
        );
        let mut b = board(4);
        b.mark_sacked(&sack(&[(2 * U, 4 * U)]), 0);
        let d = b.advance_una(4 * U);
        assert!(d.reordered);
        rack.on_delivered(200, &d, Some(50));
        assert!(rack.reordering_seen);
        assert_eq!(rack.reo_wnd(true, 5, Some(40), Some(100)), 10);
        assert_eq!(Rack::default().reo_wnd(true, 0, Some(40), Some(100)), 0);
        assert_eq!(Rack::default().reo_wnd(false, 3, Some(40), Some(100)), 0);
        assert_eq!(Rack::default().reo_wnd(false, 2, Some(40), Some(5)), 5);
    }

    #[test]
    fn rto_marks_everything_but_the_sacked() {
        let mut b = board(5);
        b.mark_sacked(&sack(&[(3 * U, 4 * U)]), 0);
        assert!(!b.on_rto());
        assert_eq!(b.flight(), 0);
        assert_eq!(b.next_lost(), Some((0, U)));
        assert!(b.on_rto(), "second expiry of the same first segment");
        assert_eq!(b.highest_unsacked(), Some(4 * U));
    }

    /// RFC 6937's example shape: 20 segments outstanding, ssthresh 10:
    /// while pipe > ssthresh, one segment leaves per two delivered.
    #[test]
    fn prr_sends_in_proportion_then_slow_starts() {
        let mut r = Recovery::new(20 * U, 20 * U);
        r.on_ack(U, 18 * U, 10 * U, U);
        assert!(r.allows(), "the fast retransmit always leaves");
        r.on_sent(U);
        let mut sent = 1;
        for _ in 0..10 {
            r.on_ack(U, 15 * U, 10 * U, U);
            while r.allows() {
                r.on_sent(U);
                sent += 1;
            }
        }
        // 11 delivered: ceil(11 * 10 / 20) = 6.
        assert_eq!(sent, 6);
        // Pipe at or below ssthresh: up to one segment more than delivered.
        r.on_ack(U, 5 * U, 10 * U, U);
        let mut more = 0;
        while r.allows() {
            r.on_sent(U);
            more += 1;
        }
        // limit = max(12 - 6, 1) + 1 = 7 segments, capped by ssthresh - pipe = 5.
        assert_eq!(more, 5);
    }
}
