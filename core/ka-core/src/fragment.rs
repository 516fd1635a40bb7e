//! The Kick-Ass fragmenter (paper §II-A).
//!
//! A departing full-size (1500-byte) packet with DF clear is cut in two so
//! that the leading fragment carries exactly `L` bytes of IP payload; the
//! rest goes in one second fragment. A leading fragment made upstream that
//! is already no longer than `L` passes (a tighter bottleneck spoke first);
//! a longer one is cut again to `L`. Non-leading fragments and DF packets
//! always pass untouched.
//!
//! Headers are made exactly as Linux `ip_do_fragment` makes them, so that
//! every stack reassembles the original datagram: header copied, same IP
//! id, offsets in 8-byte units, MF on every piece but the last (the last
//! keeps the original MF when a leading fragment is cut again), DF and the
//! reserved bit cleared, header checksum recomputed, and in the non-leading
//! piece every option without the "copied" flag overwritten with NOPs
//! (`ip_options_fragment`), keeping the header length.
//!
//! No copy of the payload is made: a [`Split`] is two small headers plus two
//! ranges of the original buffer, ready for `writev`.

use core::ops::Range;

use crate::encoding::{FRAGMENT_UNIT, FULL_PACKET_LEN, MIN_LEADING_FRAGMENT_LEN};
use crate::wire::ipv4::{Packet, MAX_HEADER_LEN, MIN_HEADER_LEN};

/// IP option type numbers that matter here (RFC 791).
const IPOPT_END: u8 = 0;
const IPOPT_NOOP: u8 = 1;
/// Top bit of an option type: copy this option into every fragment.
const IPOPT_COPIED: u8 = 0x80;

/// Why a packet leaves unchanged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pass {
    /// Not a parsable IPv4 packet (the router forwards what it cannot read).
    NotIpv4,
    /// The router is not advertising a rate (TCP mode, droptail, or a rate
    /// below the smallest encodable one).
    NotMarking,
    /// DF set: never fragmented.
    DontFragment,
    /// Offset > 0: a non-leading fragment, routed normally.
    NonLeadingFragment,
    /// A leading fragment no longer than `L`: an upstream router advertised
    /// a lower rate.
    LeadingFragmentShortEnough,
    /// A whole packet whose IP length is not 1500.
    NotFullSize,
    /// A full-size packet whose payload is not longer than `L` (long IP
    /// options): cutting would not change it.
    PayloadShortEnough,
}

/// What to do with one departing packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Pass(Pass),
    /// Cut so the leading fragment carries `leading_fragment_len` payload bytes.
    Cut {
        leading_fragment_len: usize,
    },
}

/// Decide for one packet given the leading fragment length the router
/// currently advertises (`None`: not marking).
pub fn classify(packet: &[u8], leading_fragment_len: Option<usize>) -> Verdict {
    let Ok(p) = Packet::new_checked(packet) else {
        return Verdict::Pass(Pass::NotIpv4);
    };
    if p.dont_frag() {
        return Verdict::Pass(Pass::DontFragment);
    }
    let Some(l) = leading_fragment_len else {
        return Verdict::Pass(Pass::NotMarking);
    };
    debug_assert!(l % FRAGMENT_UNIT == 0 && l >= MIN_LEADING_FRAGMENT_LEN);
    if p.frag_offset() > 0 {
        return Verdict::Pass(Pass::NonLeadingFragment);
    }
    let payload = p.payload_len();
    if p.more_frags() {
        // A leading fragment from upstream, any size: only a longer one
        // says more than we may advertise.
        if payload <= l {
            return Verdict::Pass(Pass::LeadingFragmentShortEnough);
        }
        return Verdict::Cut {
            leading_fragment_len: l,
        };
    }
    if p.total_len() as usize != FULL_PACKET_LEN {
        return Verdict::Pass(Pass::NotFullSize);
    }
    if payload <= l {
        return Verdict::Pass(Pass::PayloadShortEnough);
    }
    Verdict::Cut {
        leading_fragment_len: l,
    }
}

/// An IPv4 header of up to 60 bytes held inline (no allocation per packet).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct Header {
    bytes: [u8; MAX_HEADER_LEN],
    len: u8,
}

impl Header {
    pub fn as_bytes(&self) -> &[u8] {
        &self.bytes[..self.len as usize]
    }
}

impl core::fmt::Debug for Header {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "Header({:02x?})", self.as_bytes())
    }
}

/// The two pieces of a cut packet: each is `header` followed by the given
/// byte range of the original packet buffer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Split {
    pub lead: Header,
    pub lead_payload: Range<usize>,
    pub rest: Header,
    pub rest_payload: Range<usize>,
}

impl Split {
    /// Bytes on the wire (IP lengths of both pieces).
    pub fn wire_len(&self) -> usize {
        self.lead.len as usize
            + self.lead_payload.len()
            + self.rest.len as usize
            + self.rest_payload.len()
    }

    /// Both fragments as owned packets (tests, tools; the datapath uses
    /// `writev` on the pieces instead).
    pub fn to_packets(&self, packet: &[u8]) -> [Vec<u8>; 2] {
        let mut a = self.lead.as_bytes().to_vec();
        a.extend_from_slice(&packet[self.lead_payload.clone()]);
        let mut b = self.rest.as_bytes().to_vec();
        b.extend_from_slice(&packet[self.rest_payload.clone()]);
        [a, b]
    }
}

/// Why a cut is impossible (only for callers that skip [`classify`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitError {
    NotIpv4,
    /// `leading_fragment_len` not a positive multiple of 8 strictly inside the payload,
    /// or the packet is a non-leading fragment or has DF set.
    BadLength,
}

/// Cut `packet` so its leading fragment carries `leading_fragment_len` payload bytes.
pub fn split(packet: &[u8], leading_fragment_len: usize) -> Result<Split, SplitError> {
    let p = Packet::new_checked(packet).map_err(|_| SplitError::NotIpv4)?;
    let hl = p.header_len();
    let payload = p.payload_len();
    if leading_fragment_len == 0
        || leading_fragment_len % FRAGMENT_UNIT != 0
        || leading_fragment_len >= payload
        || p.dont_frag()
        || p.frag_offset() != 0
    {
        return Err(SplitError::BadLength);
    }
    let orig_offset = p.frag_offset();
    let orig_mf = p.more_frags();

    let mut lead = Header {
        bytes: [0; MAX_HEADER_LEN],
        len: hl as u8,
    };
    lead.bytes[..hl].copy_from_slice(p.header());
    let mut rest = lead;
    {
        let mut h = Packet::new_unchecked(&mut lead.bytes[..hl]);
        h.set_total_len((hl + leading_fragment_len) as u16);
        h.set_frag(false, true, orig_offset);
        h.fill_checksum();
    }
    {
        options_fragment(&mut rest.bytes[MIN_HEADER_LEN..hl]);
        let mut h = Packet::new_unchecked(&mut rest.bytes[..hl]);
        h.set_total_len((hl + payload - leading_fragment_len) as u16);
        // The last piece keeps MF when what we cut was itself a leading
        // fragment: more of the datagram follows from upstream.
        h.set_frag(false, orig_mf, orig_offset + leading_fragment_len);
        h.fill_checksum();
    }
    Ok(Split {
        lead,
        lead_payload: hl..hl + leading_fragment_len,
        rest,
        rest_payload: hl + leading_fragment_len..hl + payload,
    })
}

/// Linux `ip_options_fragment`: overwrite every option that lacks the
/// copied flag with NOPs, in place. Stops at END and at a malformed length,
/// leaving the remainder as it is (exactly what Linux does).
fn options_fragment(opts: &mut [u8]) {
    let mut i = 0;
    while i < opts.len() {
        match opts[i] {
            IPOPT_END => return,
            IPOPT_NOOP => {
                i += 1;
                continue;
            }
            _ => {}
        }
        if i + 1 >= opts.len() {
            return;
        }
        let optlen = opts[i + 1] as usize;
        if optlen < 2 || optlen > opts.len() - i {
            return;
        }
        if opts[i] & IPOPT_COPIED == 0 {
            opts[i..i + optlen].fill(IPOPT_NOOP);
        }
        i += optlen;
    }
}

/// Reassemble IPv4 fragments of one datagram the RFC 791 way (header of the
/// offset-0 fragment, payload pieces by offset). A test oracle: `None` when
/// the pieces do not cover the datagram exactly or disagree on overlaps.
pub fn reassemble(fragments: &[Vec<u8>]) -> Option<Vec<u8>> {
    let mut first: Option<&[u8]> = None;
    // End of the datagram as told by the piece with MF clear, if any; a
    // re-cut leading fragment has none and reassembles to a leading
    // fragment (MF still set).
    let mut last_end: Option<usize> = None;
    let mut data: Vec<Option<u8>> = Vec::new();
    for f in fragments {
        let p = Packet::new_checked(&f[..]).ok()?;
        let off = p.frag_offset();
        let pl = p.payload();
        if off == 0 {
            first = Some(&f[..p.header_len()]);
        }
        if data.len() < off + pl.len() {
            data.resize(off + pl.len(), None);
        }
        for (i, b) in pl.iter().enumerate() {
            match data[off + i] {
                Some(x) if x != *b => return None,
                _ => data[off + i] = Some(*b),
            }
        }
        if !p.more_frags() {
            last_end = Some(off + pl.len());
        }
    }
    let header = first?;
    if last_end.is_some_and(|e| e != data.len()) {
        return None;
    }
    let payload: Vec<u8> = data.into_iter().collect::<Option<Vec<u8>>>()?;
    let mut out = header.to_vec();
    out.extend_from_slice(&payload);
    let mut p = Packet::new_unchecked(&mut out[..]);
    p.set_total_len((header.len() + payload.len()) as u16);
    p.set_frag(false, last_end.is_none(), 0);
    p.fill_checksum();
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::ipv4::Repr;
    use core::net::Ipv4Addr;

    fn udp_like(total: usize, df: bool, mf: bool, offset: usize, options: Vec<u8>) -> Vec<u8> {
        let hl = 20 + options.len();
        let repr = Repr {
            src_addr: Ipv4Addr::new(198, 18, 1, 2),
            dst_addr: Ipv4Addr::new(198, 18, 2, 2),
            protocol: 17,
            ttl: 63,
            tos: 0,
            ident: 0xbeef,
            dont_frag: df,
            more_frags: mf,
            frag_offset: offset,
            options,
            payload_len: total - hl,
        };
        let payload: Vec<u8> = (0..total - hl).map(|i| (i * 7 + 3) as u8).collect();
        repr.to_bytes(&payload)
    }

    #[test]
    fn decisions() {
        let full = udp_like(1500, false, false, 0, vec![]);
        assert_eq!(
            classify(&full, Some(880)),
            Verdict::Cut {
                leading_fragment_len: 880
            }
        );
        assert_eq!(classify(&full, None), Verdict::Pass(Pass::NotMarking));
        assert_eq!(
            classify(&full, Some(1480)),
            Verdict::Pass(Pass::PayloadShortEnough)
        );
        let df = udp_like(1500, true, false, 0, vec![]);
        assert_eq!(classify(&df, Some(880)), Verdict::Pass(Pass::DontFragment));
        let short = udp_like(1499, false, false, 0, vec![]);
        assert_eq!(classify(&short, Some(24)), Verdict::Pass(Pass::NotFullSize));
        let lead = udp_like(900, false, true, 0, vec![]);
        assert_eq!(
            classify(&lead, Some(880)),
            Verdict::Pass(Pass::LeadingFragmentShortEnough)
        );
        assert_eq!(
            classify(&lead, Some(1000)),
            Verdict::Pass(Pass::LeadingFragmentShortEnough)
        );
        assert_eq!(
            classify(&lead, Some(872)),
            Verdict::Cut {
                leading_fragment_len: 872
            }
        );
        let tail = udp_like(1500, false, false, 880, vec![]);
        assert_eq!(
            classify(&tail, Some(24)),
            Verdict::Pass(Pass::NonLeadingFragment)
        );
        assert_eq!(
            classify(&[0x45, 0, 0], Some(24)),
            Verdict::Pass(Pass::NotIpv4)
        );
    }

    #[test]
    fn cut_full_packet() {
        let full = udp_like(1500, false, false, 0, vec![]);
        let s = split(&full, 880).expect("cut");
        let [a, b] = s.to_packets(&full);
        let pa = Packet::new_checked(&a[..]).expect("a");
        let pb = Packet::new_checked(&b[..]).expect("b");
        assert_eq!(
            (
                pa.total_len(),
                pa.payload_len(),
                pa.more_frags(),
                pa.frag_offset()
            ),
            (900, 880, true, 0)
        );
        assert_eq!(
            (pb.total_len(), pb.more_frags(), pb.frag_offset()),
            (620, false, 880)
        );
        assert!(pa.verify_checksum() && pb.verify_checksum());
        assert_eq!(pa.ident(), 0xbeef);
        assert_eq!(s.wire_len(), 1520);
        assert_eq!(reassemble(&[b, a]).expect("reassembles"), full);
    }

    #[test]
    fn recut_leading_fragment_keeps_mf() {
        let lead = udp_like(1500, false, true, 0, vec![]);
        let s = split(&lead, 24).expect("cut");
        let [a, b] = s.to_packets(&lead);
        let pb = Packet::new_checked(&b[..]).expect("b");
        assert!(pb.more_frags());
        assert_eq!(pb.frag_offset(), 24);
        assert_eq!(Packet::new_checked(&a[..]).expect("a").payload_len(), 24);
    }

    #[test]
    fn options_copied_or_nopped() {
        // Router alert (0x94, copied), a timestamp (0x44, not copied),
        // then END padding.
        let opts = vec![
            0x94, 0x04, 0x00, 0x00, 0x44, 0x08, 0x05, 0x00, 0, 0, 0, 0, 0, 0, 0, 0,
        ];
        let full = udp_like(1500, false, false, 0, opts);
        let s = split(&full, 24).expect("cut");
        let [a, b] = s.to_packets(&full);
        assert_eq!(&a[20..36], &full[20..36]);
        assert_eq!(
            &b[20..36],
            &[0x94, 0x04, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0]
        );
        assert_eq!(Packet::new_checked(&b[..]).expect("b").header_len(), 36);
        assert_eq!(reassemble(&[a, b]).expect("reassembles"), full);
    }

    #[test]
    fn split_rejects_nonsense() {
        let full = udp_like(1500, false, false, 0, vec![]);
        assert_eq!(split(&full, 0), Err(SplitError::BadLength));
        assert_eq!(split(&full, 20), Err(SplitError::BadLength));
        assert_eq!(split(&full, 1480), Err(SplitError::BadLength));
        assert_eq!(split(&full[..10], 24), Err(SplitError::NotIpv4));
    }
}
