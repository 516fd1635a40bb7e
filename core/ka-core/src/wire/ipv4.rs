//! IPv4 header: a zero-copy [`Packet`] view over bytes and a plain [`Repr`].
//!
//! Same split as smoltcp's `wire`: `Packet<T>` reads and writes fields in
//! place (the datapath never copies a payload it does not have to), `Repr`
//! is the parsed meaning (tests and tools build packets from it).

use core::fmt;
use core::net::Ipv4Addr;

use super::checksum;

/// Smallest IPv4 header (no options).
pub const MIN_HEADER_LEN: usize = 20;
/// IHL is 4 bits of 32-bit words: 15 * 4.
pub const MAX_HEADER_LEN: usize = 60;

/// Flag bits inside the 16-bit flags/fragment-offset field.
const FLAG_RESERVED: u16 = 0x8000;
const FLAG_DF: u16 = 0x4000;
const FLAG_MF: u16 = 0x2000;
const OFFSET_MASK: u16 = 0x1fff;

mod field {
    use core::ops::Range;
    pub const VER_IHL: usize = 0;
    pub const TOS: usize = 1;
    pub const LENGTH: Range<usize> = 2..4;
    pub const IDENT: Range<usize> = 4..6;
    pub const FLG_OFF: Range<usize> = 6..8;
    pub const TTL: usize = 8;
    pub const PROTOCOL: usize = 9;
    pub const CHECKSUM: Range<usize> = 10..12;
    pub const SRC: Range<usize> = 12..16;
    pub const DST: Range<usize> = 16..20;
}

/// Why bytes are not a usable IPv4 packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Fewer bytes than the header (or total length) claims.
    Truncated,
    /// Version is not 4, IHL < 5 or total length < IHL.
    Malformed,
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => f.write_str("truncated IPv4 packet"),
            Error::Malformed => f.write_str("malformed IPv4 header"),
        }
    }
}

impl std::error::Error for Error {}

/// A read/write view of an IPv4 packet in a byte buffer.
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap without any check; accessors may panic on short buffers.
    pub const fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }

    /// Wrap and check that every accessor is in bounds: version 4, IHL >= 5,
    /// header and total length inside the buffer. Trailing bytes beyond the
    /// total length (link padding) are allowed and ignored.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Packet { buffer };
        p.check_len()?;
        Ok(p)
    }

    pub fn check_len(&self) -> Result<(), Error> {
        let b = self.buffer.as_ref();
        if b.len() < MIN_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if self.version() != 4 {
            return Err(Error::Malformed);
        }
        let hl = self.header_len();
        if hl < MIN_HEADER_LEN {
            return Err(Error::Malformed);
        }
        if b.len() < hl {
            return Err(Error::Truncated);
        }
        let tl = self.total_len() as usize;
        if tl < hl {
            return Err(Error::Malformed);
        }
        if b.len() < tl {
            return Err(Error::Truncated);
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VER_IHL] >> 4
    }

    /// Header length in bytes (IHL * 4).
    pub fn header_len(&self) -> usize {
        ((self.buffer.as_ref()[field::VER_IHL] & 0x0f) as usize) * 4
    }

    pub fn tos(&self) -> u8 {
        self.buffer.as_ref()[field::TOS]
    }

    /// IP total length: header plus payload, in bytes.
    pub fn total_len(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::LENGTH])
    }

    pub fn ident(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::IDENT])
    }

    fn flags_offset(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::FLG_OFF])
    }

    pub fn reserved_flag(&self) -> bool {
        self.flags_offset() & FLAG_RESERVED != 0
    }

    pub fn dont_frag(&self) -> bool {
        self.flags_offset() & FLAG_DF != 0
    }

    pub fn more_frags(&self) -> bool {
        self.flags_offset() & FLAG_MF != 0
    }

    /// Fragment offset in bytes (the field counts 8-byte units).
    pub fn frag_offset(&self) -> usize {
        ((self.flags_offset() & OFFSET_MASK) as usize) * 8
    }

    /// A fragment of a larger datagram (MF set or offset > 0).
    pub fn is_fragment(&self) -> bool {
        self.flags_offset() & (FLAG_MF | OFFSET_MASK) != 0
    }

    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[field::TTL]
    }

    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[field::PROTOCOL]
    }

    pub fn checksum(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::CHECKSUM])
    }

    pub fn src_addr(&self) -> Ipv4Addr {
        let b = &self.buffer.as_ref()[field::SRC];
        Ipv4Addr::new(b[0], b[1], b[2], b[3])
    }

    pub fn dst_addr(&self) -> Ipv4Addr {
        let b = &self.buffer.as_ref()[field::DST];
        Ipv4Addr::new(b[0], b[1], b[2], b[3])
    }

    /// Header bytes including options.
    pub fn header(&self) -> &[u8] {
        &self.buffer.as_ref()[..self.header_len()]
    }

    /// Option bytes (between the fixed header and the payload).
    pub fn options(&self) -> &[u8] {
        &self.buffer.as_ref()[MIN_HEADER_LEN..self.header_len()]
    }

    /// Payload up to the total length (link padding excluded).
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..self.total_len() as usize]
    }

    /// Payload length in bytes (total length minus header).
    pub fn payload_len(&self) -> usize {
        self.total_len() as usize - self.header_len()
    }

    /// Header checksum is valid (sums to 0xffff over the header).
    pub fn verify_checksum(&self) -> bool {
        checksum::fold(checksum::sum(self.header())) == 0xffff
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn set_be16(&mut self, r: core::ops::Range<usize>, v: u16) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    pub fn set_version_and_header_len(&mut self, header_len: usize) {
        debug_assert!(
            header_len % 4 == 0 && (MIN_HEADER_LEN..=MAX_HEADER_LEN).contains(&header_len)
        );
        self.buffer.as_mut()[field::VER_IHL] = 0x40 | (header_len / 4) as u8;
    }

    pub fn set_tos(&mut self, v: u8) {
        self.buffer.as_mut()[field::TOS] = v;
    }

    pub fn set_total_len(&mut self, v: u16) {
        self.set_be16(field::LENGTH, v);
    }

    pub fn set_ident(&mut self, v: u16) {
        self.set_be16(field::IDENT, v);
    }

    /// Write flags and offset at once (offset in bytes, multiple of 8).
    /// The reserved bit is always written as 0, as Linux does.
    pub fn set_frag(&mut self, dont_frag: bool, more_frags: bool, offset_bytes: usize) {
        debug_assert!(offset_bytes % 8 == 0 && offset_bytes / 8 <= OFFSET_MASK as usize);
        let mut v = (offset_bytes / 8) as u16 & OFFSET_MASK;
        if dont_frag {
            v |= FLAG_DF;
        }
        if more_frags {
            v |= FLAG_MF;
        }
        self.set_be16(field::FLG_OFF, v);
    }

    pub fn set_ttl(&mut self, v: u8) {
        self.buffer.as_mut()[field::TTL] = v;
    }

    pub fn set_protocol(&mut self, v: u8) {
        self.buffer.as_mut()[field::PROTOCOL] = v;
    }

    pub fn set_checksum(&mut self, v: u16) {
        self.set_be16(field::CHECKSUM, v);
    }

    pub fn set_src_addr(&mut self, a: Ipv4Addr) {
        self.buffer.as_mut()[field::SRC].copy_from_slice(&a.octets());
    }

    pub fn set_dst_addr(&mut self, a: Ipv4Addr) {
        self.buffer.as_mut()[field::DST].copy_from_slice(&a.octets());
    }

    /// Recompute the header checksum over the current header bytes.
    pub fn fill_checksum(&mut self) {
        self.set_checksum(0);
        let c = !checksum::fold(checksum::sum(self.header()));
        self.set_checksum(c);
    }

    /// TTL + 1 with an incremental checksum update (RFC 1624), so a packet
    /// that the kernel decremented twice (LAN -> TUN, TUN -> WAN) leaves the
    /// router having lost exactly one hop.
    pub fn increment_ttl(&mut self) {
        let ttl = self.ttl();
        if ttl == u8::MAX {
            return;
        }
        // TTL is the high byte of the 16-bit word it shares with protocol.
        let old = u16::from_be_bytes([ttl, self.protocol()]);
        let new = u16::from_be_bytes([ttl + 1, self.protocol()]);
        self.set_ttl(ttl + 1);
        let c = checksum::update(self.checksum(), old, new);
        self.set_checksum(c);
    }

    pub fn payload_mut(&mut self) -> &mut [u8] {
        let (h, t) = (self.header_len(), self.total_len() as usize);
        &mut self.buffer.as_mut()[h..t]
    }

    pub fn options_mut(&mut self) -> &mut [u8] {
        let h = self.header_len();
        &mut self.buffer.as_mut()[MIN_HEADER_LEN..h]
    }
}

/// The meaning of an IPv4 header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Repr {
    pub src_addr: Ipv4Addr,
    pub dst_addr: Ipv4Addr,
    pub protocol: u8,
    pub ttl: u8,
    pub tos: u8,
    pub ident: u16,
    pub dont_frag: bool,
    pub more_frags: bool,
    /// In bytes, a multiple of 8.
    pub frag_offset: usize,
    /// Raw option bytes, length a multiple of 4, at most 40.
    pub options: Vec<u8>,
    pub payload_len: usize,
}

impl Repr {
    /// Parse a header; `verify_checksum` rejects a bad header checksum.
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>, verify_checksum: bool) -> Result<Repr, Error> {
        p.check_len()?;
        if verify_checksum && !p.verify_checksum() {
            return Err(Error::Malformed);
        }
        Ok(Repr {
            src_addr: p.src_addr(),
            dst_addr: p.dst_addr(),
            protocol: p.protocol(),
            ttl: p.ttl(),
            tos: p.tos(),
            ident: p.ident(),
            dont_frag: p.dont_frag(),
            more_frags: p.more_frags(),
            frag_offset: p.frag_offset(),
            options: p.options().to_vec(),
            payload_len: p.payload_len(),
        })
    }

    pub fn header_len(&self) -> usize {
        MIN_HEADER_LEN + self.options.len()
    }

    pub fn total_len(&self) -> usize {
        self.header_len() + self.payload_len
    }

    /// Write the header (checksum included) into the front of `p`.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        assert!(self.options.len() % 4 == 0 && self.options.len() <= 40);
        p.set_version_and_header_len(self.header_len());
        p.set_tos(self.tos);
        p.set_total_len(self.total_len() as u16);
        p.set_ident(self.ident);
        p.set_frag(self.dont_frag, self.more_frags, self.frag_offset);
        p.set_ttl(self.ttl);
        p.set_protocol(self.protocol);
        p.set_src_addr(self.src_addr);
        p.set_dst_addr(self.dst_addr);
        p.options_mut().copy_from_slice(&self.options);
        p.fill_checksum();
    }

    /// A whole packet: this header followed by `payload` (whose length must
    /// equal `payload_len`).
    pub fn to_bytes(&self, payload: &[u8]) -> Vec<u8> {
        assert_eq!(payload.len(), self.payload_len);
        let mut buf = vec![0u8; self.total_len()];
        buf[self.header_len()..].copy_from_slice(payload);
        let mut p = Packet::new_unchecked(&mut buf[..]);
        self.emit(&mut p);
        buf
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // A UDP/IPv4 packet as scapy builds it (independent checksum code):
    // IP(src=198.18.1.2, dst=198.18.2.2, id=0x1c46, flags=DF, ttl=64)
    // / UDP(sport=12345, dport=53) / b"\xde\xad\xbe\xef".
    const PACKET: [u8; 32] = [
        0x45, 0x00, 0x00, 0x20, 0x1c, 0x46, 0x40, 0x00, 0x40, 0x11, 0x8f, 0x5e, 0xc6, 0x12, 0x01,
        0x02, 0xc6, 0x12, 0x02, 0x02, 0x30, 0x39, 0x00, 0x35, 0x00, 0x0c, 0xa2, 0xa1, 0xde, 0xad,
        0xbe, 0xef,
    ];

    fn repr() -> Repr {
        Repr {
            src_addr: Ipv4Addr::new(198, 18, 1, 2),
            dst_addr: Ipv4Addr::new(198, 18, 2, 2),
            protocol: 17,
            ttl: 64,
            tos: 0,
            ident: 0x1c46,
            dont_frag: true,
            more_frags: false,
            frag_offset: 0,
            options: vec![],
            payload_len: 12,
        }
    }

    #[test]
    fn parse_real_bytes() {
        let p = Packet::new_checked(&PACKET[..]).expect("valid");
        assert!(p.verify_checksum());
        assert_eq!(Repr::parse(&p, true).expect("parse"), repr());
        assert!(!p.is_fragment());
        assert_eq!(p.payload(), &PACKET[20..]);
    }

    #[test]
    fn emit_round_trips_bytes() {
        assert_eq!(repr().to_bytes(&PACKET[20..]), PACKET.to_vec());
    }

    #[test]
    fn increment_ttl_keeps_checksum_valid() {
        let mut b = PACKET;
        let mut p = Packet::new_unchecked(&mut b[..]);
        p.increment_ttl();
        assert_eq!(p.ttl(), 65);
        assert!(p.verify_checksum());
        let mut full = PACKET;
        let mut q = Packet::new_unchecked(&mut full[..]);
        q.set_ttl(65);
        q.fill_checksum();
        assert_eq!(b, full);
    }

    #[test]
    fn rejects_short_and_bad() {
        assert_eq!(
            Packet::new_checked(&PACKET[..10]).unwrap_err(),
            Error::Truncated
        );
        assert_eq!(
            Packet::new_checked(&PACKET[..31]).unwrap_err(),
            Error::Truncated
        );
        let mut b = PACKET;
        b[0] = 0x65;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::Malformed);
        b[0] = 0x44;
        assert_eq!(Packet::new_checked(&b[..]).unwrap_err(), Error::Malformed);
        let mut c = PACKET;
        c[11] ^= 1;
        let p = Packet::new_checked(&c[..]).expect("len ok");
        assert_eq!(Repr::parse(&p, true).unwrap_err(), Error::Malformed);
    }

    #[test]
    fn padding_is_ignored() {
        let mut b = PACKET.to_vec();
        b.extend_from_slice(&[0; 14]);
        let p = Packet::new_checked(&b[..]).expect("valid");
        assert_eq!(p.payload().len(), 12);
    }
}
