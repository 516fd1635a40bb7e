//! Which datagram had which leading fragment: the bridge between the
//! AF_PACKET copy of each fragment (seen before reassembly) and the
//! reassembled datagram the UDP socket delivers later.
//!
//! The UDP socket tells neither the IP id nor anything about fragments, so
//! the two are joined by what both can see: the datagram's own bytes. The
//! key is (source address, source port, UDP length, first 32 bytes of the
//! transport datagram). Those 32 bytes are the transport's fixed header:
//! kind, flow id, sequence and the sender's nanosecond timestamp, so the
//! key names one transmission (a retransmission carries another timestamp)
//! and needs no knowledge of the protocol beyond "the first 32 bytes".
//!
//! They are 40 bytes into the IP payload (after the 8-byte UDP header). A
//! leading fragment is at least 24 bytes long (rate code 24, ~120 kbit/s),
//! so below L = 40 the rest of the key sits in the next fragment: the
//! capture also takes fragments whose offset is below 40 and the key is
//! assembled from the pieces (keyed by source, destination and IP id until
//! complete). Everything is bounded (entries, partial keys) and forgotten
//! after `max_age`.
//!
//! Pure: bytes and times in, lengths out. The socket lives in `afpacket`.

use std::collections::hash_map::Entry;
use std::collections::{HashMap, VecDeque};
use std::net::{Ipv4Addr, SocketAddrV4};

use ka_transport::Nanos;

/// Transport bytes that identify one transmission.
pub const HEAD_LEN: usize = 32;
const UDP_HEADER_LEN: usize = 8;
/// IP payload bytes a key needs: UDP header + [`HEAD_LEN`].
pub const KEY_SPAN: usize = UDP_HEADER_LEN + HEAD_LEN;
const IP_PROTO_UDP: u8 = 17;

/// One transmission, as both the capture and the UDP socket see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DatagramKey {
    pub src: Ipv4Addr,
    pub sport: u16,
    /// UDP length field: 8 + payload length.
    pub udp_len: u16,
    pub head: [u8; HEAD_LEN],
}

impl DatagramKey {
    /// The key of a datagram the UDP socket delivered; None if too short
    /// to carry one (such a datagram was never worth fragmenting).
    pub fn from_udp(peer: SocketAddrV4, payload: &[u8]) -> Option<DatagramKey> {
        if payload.len() < HEAD_LEN || payload.len() + UDP_HEADER_LEN > u16::MAX as usize {
            return None;
        }
        let mut head = [0u8; HEAD_LEN];
        head.copy_from_slice(&payload[..HEAD_LEN]);
        Some(DatagramKey {
            src: *peer.ip(),
            sport: peer.port(),
            udp_len: (payload.len() + UDP_HEADER_LEN) as u16,
            head,
        })
    }

    /// From the first [`KEY_SPAN`] bytes of the IP payload (UDP header
    /// included); also returns the UDP destination port.
    fn from_ip_payload(src: Ipv4Addr, p: &[u8; KEY_SPAN]) -> (DatagramKey, u16) {
        let mut head = [0u8; HEAD_LEN];
        head.copy_from_slice(&p[UDP_HEADER_LEN..]);
        let key = DatagramKey {
            src,
            sport: u16::from_be_bytes([p[0], p[1]]),
            udp_len: u16::from_be_bytes([p[4], p[5]]),
            head,
        };
        (key, u16::from_be_bytes([p[2], p[3]]))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableConfig {
    /// UDP destination port of our datagrams (others are ignored).
    pub port: u16,
    /// An observation not claimed within this long is forgotten.
    pub max_age: Nanos,
    pub max_entries: usize,
    /// Keys still being assembled from pieces (leading fragment < 40 bytes).
    pub max_partial: usize,
}

impl TableConfig {
    pub fn new(port: u16) -> Self {
        TableConfig {
            port,
            max_age: 2_000_000_000,
            max_entries: 65_536,
            max_partial: 4_096,
        }
    }
}

/// What the table did with one captured packet (tests and counters).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Observed {
    /// Not IPv4/UDP, or too short to parse.
    Ignored,
    /// An IPv4 packet that is not a fragment.
    Whole,
    /// A leading fragment for another port.
    OtherPort,
    /// A leading fragment, recorded with its IP payload length.
    Leading(u16),
    /// A piece of a key still incomplete.
    Piece,
    /// A trailing fragment carrying no key bytes.
    Tail,
}

/// Counters.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableStats {
    pub captured: u64,
    pub ignored: u64,
    pub leading_fragments: u64,
    /// Leading fragments whose key needed a later piece.
    pub assembled_keys: u64,
    pub other_port: u64,
    /// Datagrams the UDP socket delivered that had a leading fragment.
    pub matched: u64,
    /// ... and that had none (arrived whole).
    pub unmatched: u64,
    /// Observations never claimed (the datagram was not delivered, e.g.
    /// a fragment was lost and reassembly failed).
    pub expired: u64,
    /// Forgotten early because the table was full.
    pub evicted: u64,
    pub partial_expired: u64,
    pub partial_evicted: u64,
}

#[derive(Debug, Clone, Copy)]
struct Seen {
    leading_fragment_len: u16,
    /// Copies observed and not yet claimed (a duplicated datagram is
    /// reassembled and delivered twice).
    count: u32,
    at: Nanos,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct PieceKey {
    src: Ipv4Addr,
    dst: Ipv4Addr,
    id: u16,
}

#[derive(Debug, Clone)]
struct Partial {
    bytes: [u8; KEY_SPAN],
    /// Bit i: byte i of the span is known.
    known: u64,
    leading_fragment_len: Option<u16>,
    at: Nanos,
}

const ALL_KNOWN: u64 = (1 << KEY_SPAN) - 1;

/// The table of observed leading fragments.
#[derive(Debug)]
pub struct LeadingFragments {
    cfg: TableConfig,
    seen: HashMap<DatagramKey, Seen>,
    order: VecDeque<(Nanos, DatagramKey)>,
    partial: HashMap<PieceKey, Partial>,
    partial_order: VecDeque<(Nanos, PieceKey)>,
    stats: TableStats,
}

impl LeadingFragments {
    pub fn new(cfg: TableConfig) -> Self {
        LeadingFragments {
            cfg,
            seen: HashMap::new(),
            order: VecDeque::new(),
            partial: HashMap::new(),
            partial_order: VecDeque::new(),
            stats: TableStats::default(),
        }
    }

    pub fn stats(&self) -> &TableStats {
        &self.stats
    }

    pub fn len(&self) -> usize {
        self.seen.len()
    }

    pub fn is_empty(&self) -> bool {
        self.seen.is_empty()
    }

    /// One captured IPv4 packet (from its IP header on; it may be cut
    /// short by the capture's snap length, the header's lengths count).
    pub fn observe(&mut self, now: Nanos, ip: &[u8]) -> Observed {
        self.stats.captured += 1;
        self.expire(now);
        let r = self.observe_inner(now, ip);
        match r {
            Observed::Ignored => self.stats.ignored += 1,
            Observed::OtherPort => self.stats.other_port += 1,
            Observed::Leading(_) => self.stats.leading_fragments += 1,
            _ => {}
        }
        r
    }

    fn observe_inner(&mut self, now: Nanos, ip: &[u8]) -> Observed {
        if ip.len() < 20 || ip[0] >> 4 != 4 {
            return Observed::Ignored;
        }
        let ihl = (ip[0] & 0x0f) as usize * 4;
        let total = u16::from_be_bytes([ip[2], ip[3]]) as usize;
        if ihl < 20 || ip.len() < ihl || total < ihl || ip[9] != IP_PROTO_UDP {
            return Observed::Ignored;
        }
        let frag = u16::from_be_bytes([ip[6], ip[7]]);
        let more = frag & 0x2000 != 0;
        let offset = (frag & 0x1fff) as usize * 8;
        if !more && offset == 0 {
            return Observed::Whole;
        }
        let src = Ipv4Addr::new(ip[12], ip[13], ip[14], ip[15]);
        let dst = Ipv4Addr::new(ip[16], ip[17], ip[18], ip[19]);
        let id = u16::from_be_bytes([ip[4], ip[5]]);
        let piece_len = total - ihl;
        let data = &ip[ihl..ip.len().min(total)];
        if offset == 0 {
            // Too short to hold a UDP header: not a fragment of ours.
            if data.len() < UDP_HEADER_LEN {
                return Observed::Ignored;
            }
            if u16::from_be_bytes([data[2], data[3]]) != self.cfg.port {
                return Observed::OtherPort;
            }
            let lfl = piece_len as u16;
            if data.len() >= KEY_SPAN {
                let mut span = [0u8; KEY_SPAN];
                span.copy_from_slice(&data[..KEY_SPAN]);
                let (key, _) = DatagramKey::from_ip_payload(src, &span);
                self.record(now, key, lfl);
                return Observed::Leading(lfl);
            }
            let pk = PieceKey { src, dst, id };
            let done = {
                let p = self.partial_entry(now, pk);
                p.leading_fragment_len = Some(lfl);
                merge(p, 0, data);
                p.known == ALL_KNOWN
            };
            if done {
                self.finish(now, pk);
            }
            return Observed::Leading(lfl);
        }
        if offset >= KEY_SPAN {
            return Observed::Tail;
        }
        let pk = PieceKey { src, dst, id };
        let done = {
            let p = self.partial_entry(now, pk);
            merge(p, offset, data);
            p.known == ALL_KNOWN && p.leading_fragment_len.is_some()
        };
        if done {
            self.finish(now, pk);
        }
        Observed::Piece
    }

    fn partial_entry(&mut self, now: Nanos, pk: PieceKey) -> &mut Partial {
        if !self.partial.contains_key(&pk) {
            while self.partial.len() >= self.cfg.max_partial {
                let Some((_, old)) = self.partial_order.pop_front() else {
                    break;
                };
                if self.partial.remove(&old).is_some() {
                    self.stats.partial_evicted += 1;
                }
            }
            self.partial_order.push_back((now, pk));
        }
        self.partial.entry(pk).or_insert(Partial {
            bytes: [0; KEY_SPAN],
            known: 0,
            leading_fragment_len: None,
            at: now,
        })
    }

    fn finish(&mut self, now: Nanos, pk: PieceKey) {
        let Some(p) = self.partial.remove(&pk) else {
            return;
        };
        let (key, dport) = DatagramKey::from_ip_payload(pk.src, &p.bytes);
        if dport != self.cfg.port {
            return;
        }
        if let Some(lfl) = p.leading_fragment_len {
            self.stats.assembled_keys += 1;
            self.record(now, key, lfl);
        }
    }

    fn record(&mut self, now: Nanos, key: DatagramKey, lfl: u16) {
        match self.seen.entry(key) {
            Entry::Occupied(mut e) => {
                let s = e.get_mut();
                s.count = s.count.saturating_add(1);
                s.leading_fragment_len = lfl;
            }
            Entry::Vacant(e) => {
                e.insert(Seen {
                    leading_fragment_len: lfl,
                    count: 1,
                    at: now,
                });
                self.order.push_back((now, key));
            }
        }
        while self.seen.len() > self.cfg.max_entries {
            let Some((at, old)) = self.order.pop_front() else {
                break;
            };
            if self.seen.get(&old).is_some_and(|s| s.at == at) {
                self.seen.remove(&old);
                self.stats.evicted += 1;
            }
        }
    }

    /// The leading_fragment_len of the datagram the UDP socket delivered
    /// from `peer`, or None if it arrived whole. Each observation is
    /// claimed once.
    pub fn take(&mut self, now: Nanos, peer: SocketAddrV4, payload: &[u8]) -> Option<u16> {
        let found = self.claim(now, peer, payload);
        if found.is_none() {
            self.note_whole();
        }
        found
    }

    /// [`take`](Self::take) without counting a miss: the caller may look
    /// again (after reading more of the capture) before concluding.
    pub fn claim(&mut self, now: Nanos, peer: SocketAddrV4, payload: &[u8]) -> Option<u16> {
        self.expire(now);
        let key = DatagramKey::from_udp(peer, payload)?;
        let Entry::Occupied(mut e) = self.seen.entry(key) else {
            return None;
        };
        let s = e.get_mut();
        let lfl = s.leading_fragment_len;
        s.count -= 1;
        if s.count == 0 {
            e.remove();
        }
        self.stats.matched += 1;
        Some(lfl)
    }

    /// Count a delivered datagram that had no leading fragment.
    pub fn note_whole(&mut self) {
        self.stats.unmatched += 1;
    }

    /// Like [`take`](Self::take) but only asks: nothing is claimed or counted.
    pub fn peek(&self, peer: SocketAddrV4, payload: &[u8]) -> Option<u16> {
        let key = DatagramKey::from_udp(peer, payload)?;
        self.seen.get(&key).map(|s| s.leading_fragment_len)
    }

    /// Forget what is older than `max_age`.
    pub fn expire(&mut self, now: Nanos) {
        let max_age = self.cfg.max_age;
        while let Some(&(at, key)) = self.order.front() {
            if at.saturating_add(max_age) > now {
                break;
            }
            self.order.pop_front();
            if self.seen.get(&key).is_some_and(|s| s.at == at) {
                self.seen.remove(&key);
                self.stats.expired += 1;
            }
        }
        while let Some(&(at, pk)) = self.partial_order.front() {
            if at.saturating_add(max_age) > now {
                break;
            }
            self.partial_order.pop_front();
            if self.partial.get(&pk).is_some_and(|p| p.at == at) {
                self.partial.remove(&pk);
                self.stats.partial_expired += 1;
            }
        }
    }
}

/// Copy the part of `data` (IP payload bytes at `offset`) inside the span.
fn merge(p: &mut Partial, offset: usize, data: &[u8]) {
    if offset >= KEY_SPAN {
        return;
    }
    let n = data.len().min(KEY_SPAN - offset);
    p.bytes[offset..offset + n].copy_from_slice(&data[..n]);
    for i in offset..offset + n {
        p.known |= 1 << i;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SRC: Ipv4Addr = Ipv4Addr::new(198, 18, 1, 2);
    const DST: Ipv4Addr = Ipv4Addr::new(198, 18, 2, 2);
    const PORT: u16 = 7000;

    /// A UDP datagram (header + payload) from SRC:5555 to DST:PORT.
    fn udp(payload: &[u8]) -> Vec<u8> {
        let mut v = Vec::new();
        v.extend_from_slice(&5555u16.to_be_bytes());
        v.extend_from_slice(&PORT.to_be_bytes());
        v.extend_from_slice(&((payload.len() + 8) as u16).to_be_bytes());
        v.extend_from_slice(&[0, 0]);
        v.extend_from_slice(payload);
        v
    }

    /// Cut an IP payload the way a router does: pieces of the given
    /// lengths (multiples of 8 but the last), as IPv4 packets.
    fn fragments(ip_payload: &[u8], id: u16, cuts: &[usize]) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        let mut off = 0;
        for (i, &len) in cuts.iter().enumerate() {
            let last = i + 1 == cuts.len();
            let piece = &ip_payload[off..off + len];
            let mut h = vec![0x45, 0, 0, 0, 0, 0, 0, 0, 64, 17, 0, 0];
            h[2..4].copy_from_slice(&((20 + len) as u16).to_be_bytes());
            h[4..6].copy_from_slice(&id.to_be_bytes());
            let frag = (off / 8) as u16 | if last { 0 } else { 0x2000 };
            h[6..8].copy_from_slice(&frag.to_be_bytes());
            h.extend_from_slice(&SRC.octets());
            h.extend_from_slice(&DST.octets());
            h.extend_from_slice(piece);
            out.push(h);
            off += len;
        }
        assert_eq!(off, ip_payload.len());
        out
    }

    fn payload(seed: u8) -> Vec<u8> {
        (0..1472u32).map(|i| (i as u8).wrapping_mul(seed)).collect()
    }

    fn peer() -> SocketAddrV4 {
        SocketAddrV4::new(SRC, 5555)
    }

    #[test]
    fn leading_fragment_names_its_datagram() {
        let mut t = LeadingFragments::new(TableConfig::new(PORT));
        let p = payload(3);
        let frags = fragments(&udp(&p), 1, &[584, 1480 - 584]);
        assert_eq!(t.observe(10, &frags[0]), Observed::Leading(584));
        assert_eq!(t.observe(11, &frags[1]), Observed::Tail);
        // Another datagram (other bytes) arrived whole: no entry.
        assert_eq!(t.take(12, peer(), &payload(5)), None);
        assert_eq!(t.take(12, peer(), &p), Some(584));
        // Claimed once.
        assert_eq!(t.take(13, peer(), &p), None);
        // The capture may be cut by the snap length: the header counts.
        let mut t2 = LeadingFragments::new(TableConfig::new(PORT));
        assert_eq!(t2.observe(1, &frags[0][..80]), Observed::Leading(584));
        assert_eq!(t2.take(2, peer(), &p), Some(584));
        // Other peer, other port: no match.
        assert_eq!(
            t2.take(2, SocketAddrV4::new(SRC, 5556), &p),
            None,
            "source port is part of the key"
        );
        assert_eq!(t.stats().matched, 1);
        assert_eq!(t.stats().unmatched, 2);
    }

    #[test]
    fn short_leading_fragment_takes_the_key_from_the_next_piece() {
        for lead in [8usize, 16, 24, 32] {
            for reorder in [false, true] {
                let mut t = LeadingFragments::new(TableConfig::new(PORT));
                let p = payload(7);
                let frags = fragments(&udp(&p), 9, &[lead, 1480 - lead]);
                let order: Vec<&Vec<u8>> = if reorder {
                    frags.iter().rev().collect()
                } else {
                    frags.iter().collect()
                };
                for f in order {
                    t.observe(5, f);
                }
                assert_eq!(t.take(6, peer(), &p), Some(lead as u16), "lead {lead}");
            }
        }
        // Three small pieces.
        let mut t = LeadingFragments::new(TableConfig::new(PORT));
        let p = payload(9);
        for f in fragments(&udp(&p), 2, &[24, 8, 1448]) {
            t.observe(5, &f);
        }
        assert_eq!(t.take(6, peer(), &p), Some(24));
        assert_eq!(t.stats().assembled_keys, 1);
    }

    #[test]
    fn duplicates_are_claimed_once_each_and_old_entries_expire() {
        let mut t = LeadingFragments::new(TableConfig::new(PORT));
        let p = payload(11);
        let f = fragments(&udp(&p), 3, &[1000, 480]);
        t.observe(0, &f[0]);
        t.observe(0, &f[0]);
        assert_eq!(t.take(1, peer(), &p), Some(1000));
        assert_eq!(t.take(1, peer(), &p), Some(1000));
        assert_eq!(t.take(1, peer(), &p), None);
        t.observe(0, &f[0]);
        assert_eq!(t.len(), 1);
        t.expire(2_000_000_000);
        assert!(t.is_empty());
        assert_eq!(t.stats().expired, 1);
        assert_eq!(t.take(2_000_000_001, peer(), &p), None);
    }

    #[test]
    fn other_ports_whole_packets_and_garbage_are_ignored() {
        let mut t = LeadingFragments::new(TableConfig::new(PORT + 1));
        let p = payload(13);
        let f = fragments(&udp(&p), 4, &[584, 896]);
        assert_eq!(t.observe(0, &f[0]), Observed::OtherPort);
        let whole = fragments(&udp(&p[..100]), 5, &[108]);
        assert_eq!(t.observe(0, &whole[0]), Observed::Whole);
        for n in 0..40 {
            t.observe(0, &f[0][..n]);
        }
        let mut bad = f[0].clone();
        bad[0] = 0x65; // IPv6 version nibble
        assert_eq!(t.observe(0, &bad), Observed::Ignored);
        bad[0] = 0x43; // IHL 12 bytes
        assert_eq!(t.observe(0, &bad), Observed::Ignored);
        assert!(t.is_empty());
    }

    #[test]
    fn table_is_bounded() {
        let mut cfg = TableConfig::new(PORT);
        cfg.max_entries = 16;
        cfg.max_partial = 4;
        let mut t = LeadingFragments::new(cfg);
        for i in 0..100u16 {
            let mut p = payload(1);
            p[0..2].copy_from_slice(&i.to_be_bytes());
            let f = fragments(&udp(&p), i, &[584, 896]);
            t.observe(i as u64, &f[0]);
            // Pieces that never complete.
            let g = fragments(&udp(&p), 1000 + i, &[24, 1456]);
            t.observe(i as u64, &g[1]);
        }
        assert_eq!(t.len(), 16);
        assert_eq!(t.stats().evicted, 84);
        assert!(t.partial.len() <= 4);
        // The newest survive.
        let mut p = payload(1);
        p[0..2].copy_from_slice(&99u16.to_be_bytes());
        assert_eq!(t.take(100, peer(), &p), Some(584));
    }
}
