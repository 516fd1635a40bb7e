//! The transport's datagram format, smoltcp style: a zero-copy [`Packet`]
//! view that reads and writes fields in place, beside a plain [`Repr`] with
//! `parse`/`emit`. Parsing never panics, whatever the bytes.
//!
//! Every datagram starts with the same 16-byte base header; the kind decides
//! what the remaining fixed words mean. All integers are big-endian.
//!
//! | offset | len | field |
//! | --- | --- | --- |
//! | 0 | 2 | magic `"KA"` |
//! | 2 | 1 | version (1) |
//! | 3 | 1 | kind |
//! | 4 | 8 | flow id |
//! | 12 | 1 | flags (meaning per kind) |
//! | 13 | 1 | token length (HANDSHAKE), status (HANDSHAKE_ACK), SACK block count (ACK), else 0 |
//! | 14 | 2 | payload length (DATA), leading_fragment_len echo (HANDSHAKE_ACK, ACK; 0 = arrived whole), else 0 |
//! | 16 | 8 | flow size (HANDSHAKE), advertised_rate echo in bytes/s (HANDSHAKE_ACK; 0 = none), sequence = byte offset (DATA), cumulative ack (ACK), final size (FIN, FIN_ACK), the triggering DATA's sequence or FIN's final size (RESET) |
//! | 24 | 8 | send timestamp (HANDSHAKE, DATA, FIN) or its echo (HANDSHAKE_ACK, ACK, FIN_ACK, RESET), ns |
//! | 32 | .. | token + zero padding (HANDSHAKE), payload (DATA), advertised_rate echo u64 + SACK blocks of 2 x u64 (ACK) |
//!
//! RTT_INDICATOR is the base header followed by zero padding: its only
//! message is its IP length (paper II-B), see [`rtt_indicator_payload_len`].
//!
//! RESET (32 bytes) answers a DATA or FIN for which the receiver holds no
//! flow (it restarted, or dropped the flow): the sender learns at once that
//! its flow is gone instead of retransmitting into silence. It echoes the
//! triggering datagram's sequence and timestamp, so only someone who saw
//! that datagram can forge one; it is never larger than what triggered it.

use core::fmt;

use ka_core::encoding;

/// First two bytes of every datagram. With the version byte they let a
/// receiver drop stray traffic cheaply and let a future format coexist.
pub const MAGIC: [u8; 2] = *b"KA";
/// Format version carried in byte 2.
pub const VERSION: u8 = 1;

/// IPv4 header without options, as our sockets send it.
pub const IPV4_HEADER_LEN: usize = 20;
/// UDP header.
pub const UDP_HEADER_LEN: usize = 8;
/// IP + UDP overhead of every datagram.
pub const IP_UDP_OVERHEAD: usize = IPV4_HEADER_LEN + UDP_HEADER_LEN;
/// UDP payload of a full-size (IP length 1500) datagram: the only size a
/// Kick-Ass router marks (paper II-A).
pub const FULL_UDP_PAYLOAD_LEN: usize = encoding::FULL_PACKET_LEN - IP_UDP_OVERHEAD;

/// The base header shared by every kind.
pub const BASE_HEADER_LEN: usize = 16;
/// Fixed part of HANDSHAKE (token and padding follow).
pub const HANDSHAKE_HEADER_LEN: usize = 32;
/// A HANDSHAKE is never shorter than this, so the receiver's reply (at most
/// [`HANDSHAKE_ACK_LEN`]) is never larger than what triggered it: the
/// anti-amplification rule holds by construction (cf. QUIC's padded Initial).
pub const MIN_HANDSHAKE_LEN: usize = 64;
/// Flow tokens are opaque to the transport and at most this long.
pub const MAX_TOKEN_LEN: usize = 64;
/// HANDSHAKE_ACK is fixed-size.
pub const HANDSHAKE_ACK_LEN: usize = 32;
/// DATA header; the payload follows.
pub const DATA_HEADER_LEN: usize = 32;
/// Payload of a full-size DATA datagram: IP 20 + UDP 8 + 32 + 1440 = 1500.
pub const MAX_DATA_PAYLOAD: usize = FULL_UDP_PAYLOAD_LEN - DATA_HEADER_LEN;
/// ACK without SACK blocks.
pub const ACK_HEADER_LEN: usize = 40;
/// Like TCP with timestamps (RFC 2018 allows 3 then), a few blocks suffice:
/// the first always reports the most recent arrival.
pub const MAX_SACK_BLOCKS: usize = 4;
pub const SACK_BLOCK_LEN: usize = 16;
/// FIN and FIN_ACK are fixed-size.
pub const FIN_LEN: usize = 32;
/// Smallest RTT_INDICATOR (the shell pads it to the indicator length).
pub const MIN_RTT_INDICATOR_LEN: usize = BASE_HEADER_LEN;

/// HANDSHAKE flag: the client wants Kick-Ass (it clears DF on data and will
/// read advertised rates from ACKs).
pub const FLAG_KICKASS: u8 = 0x01;
/// HANDSHAKE flag: this opening datagram is padded to IP length 1500 with
/// DF clear, so a Kick-Ass router marks it and the first rate comes back in
/// the HANDSHAKE_ACK (our improvement over paper III-C2, which loses an RTT).
pub const FLAG_PADDED: u8 = 0x02;
/// DATA flag: a retransmission (diagnostics only).
pub const FLAG_RETRANSMISSION: u8 = 0x01;
/// ACK flag: ECN-echo, the echoed data datagram arrived CE-marked (RFC 3168).
pub const FLAG_ECE: u8 = 0x01;

mod field {
    use core::ops::Range;
    pub const MAGIC: Range<usize> = 0..2;
    pub const VERSION: usize = 2;
    pub const KIND: usize = 3;
    pub const FLOW_ID: Range<usize> = 4..12;
    pub const FLAGS: usize = 12;
    pub const AUX8: usize = 13;
    pub const AUX16: Range<usize> = 14..16;
    pub const WORD0: Range<usize> = 16..24;
    pub const WORD1: Range<usize> = 24..32;
    pub const WORD2: Range<usize> = 32..40;
    pub const TAIL_32: usize = 32;
    pub const SACK: usize = 40;
}

/// Datagram kinds (byte 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum Kind {
    Handshake = 1,
    HandshakeAck = 2,
    Data = 3,
    Ack = 4,
    Fin = 5,
    FinAck = 6,
    RttIndicator = 7,
    Reset = 8,
}

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Handshake,
            2 => Kind::HandshakeAck,
            3 => Kind::Data,
            4 => Kind::Ack,
            5 => Kind::Fin,
            6 => Kind::FinAck,
            7 => Kind::RttIndicator,
            8 => Kind::Reset,
            _ => return None,
        })
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Kind::Handshake => "HANDSHAKE",
            Kind::HandshakeAck => "HANDSHAKE_ACK",
            Kind::Data => "DATA",
            Kind::Ack => "ACK",
            Kind::Fin => "FIN",
            Kind::FinAck => "FIN_ACK",
            Kind::RttIndicator => "RTT_INDICATOR",
            Kind::Reset => "RESET",
        }
    }
}

/// Why bytes are not a datagram of ours. Every variant is a drop, counted by
/// the endpoint; none is ever a panic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Error {
    /// Shorter than the fixed part of its kind.
    Truncated,
    /// Not our magic: stray traffic.
    BadMagic,
    UnsupportedVersion(u8),
    UnknownKind(u8),
    /// The length the datagram declares (payload length, token length, SACK
    /// count) disagrees with its size, or a fixed-size kind has extra bytes.
    BadLength,
    /// HANDSHAKE shorter than [`MIN_HANDSHAKE_LEN`] (anti-amplification).
    HandshakeTooShort,
    TokenTooLong,
    TooManySackBlocks,
    /// A SACK block with start >= end.
    BadSackBlock,
    UnknownStatus(u8),
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::Truncated => f.write_str("truncated datagram"),
            Error::BadMagic => f.write_str("not a Kick-Ass transport datagram (bad magic)"),
            Error::UnsupportedVersion(v) => write!(f, "unsupported format version {v}"),
            Error::UnknownKind(k) => write!(f, "unknown datagram kind {k}"),
            Error::BadLength => f.write_str("declared length disagrees with datagram size"),
            Error::HandshakeTooShort => write!(
                f,
                "handshake shorter than {MIN_HANDSHAKE_LEN} bytes (anti-amplification)"
            ),
            Error::TokenTooLong => write!(f, "token longer than {MAX_TOKEN_LEN} bytes"),
            Error::TooManySackBlocks => write!(f, "more than {MAX_SACK_BLOCKS} SACK blocks"),
            Error::BadSackBlock => f.write_str("SACK block with start >= end"),
            Error::UnknownStatus(s) => write!(f, "unknown handshake status {s}"),
        }
    }
}

impl std::error::Error for Error {}

fn be64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_be_bytes(a)
}

fn be16(b: &[u8]) -> u16 {
    u16::from_be_bytes([b[0], b[1]])
}

/// A read/write view of one transport datagram (the UDP payload).
#[derive(Debug, Clone)]
pub struct Packet<T: AsRef<[u8]>> {
    buffer: T,
}

impl<T: AsRef<[u8]>> Packet<T> {
    /// Wrap without checks; accessors may panic on short buffers.
    pub const fn new_unchecked(buffer: T) -> Self {
        Packet { buffer }
    }

    /// Wrap and check that every accessor of this kind is in bounds and
    /// that declared lengths match the datagram size.
    pub fn new_checked(buffer: T) -> Result<Self, Error> {
        let p = Packet { buffer };
        p.check_len()?;
        Ok(p)
    }

    pub fn check_len(&self) -> Result<(), Error> {
        let b = self.buffer.as_ref();
        if b.len() < BASE_HEADER_LEN {
            return Err(Error::Truncated);
        }
        if b[field::MAGIC] != MAGIC {
            return Err(Error::BadMagic);
        }
        if b[field::VERSION] != VERSION {
            return Err(Error::UnsupportedVersion(b[field::VERSION]));
        }
        let kind = Kind::from_u8(b[field::KIND]).ok_or(Error::UnknownKind(b[field::KIND]))?;
        let len = b.len();
        match kind {
            Kind::Handshake => {
                if len < HANDSHAKE_HEADER_LEN {
                    return Err(Error::Truncated);
                }
                let tl = self.aux8() as usize;
                if tl > MAX_TOKEN_LEN {
                    return Err(Error::TokenTooLong);
                }
                if len < HANDSHAKE_HEADER_LEN + tl {
                    return Err(Error::BadLength);
                }
                if len < MIN_HANDSHAKE_LEN {
                    return Err(Error::HandshakeTooShort);
                }
            }
            Kind::HandshakeAck => fixed(len, HANDSHAKE_ACK_LEN)?,
            Kind::Fin | Kind::FinAck | Kind::Reset => fixed(len, FIN_LEN)?,
            Kind::Data => {
                if len < DATA_HEADER_LEN {
                    return Err(Error::Truncated);
                }
                if len != DATA_HEADER_LEN + self.aux16() as usize {
                    return Err(Error::BadLength);
                }
            }
            Kind::Ack => {
                if len < ACK_HEADER_LEN {
                    return Err(Error::Truncated);
                }
                let n = self.aux8() as usize;
                if n > MAX_SACK_BLOCKS {
                    return Err(Error::TooManySackBlocks);
                }
                if len != ACK_HEADER_LEN + n * SACK_BLOCK_LEN {
                    return Err(Error::BadLength);
                }
            }
            Kind::RttIndicator => {}
        }
        Ok(())
    }

    pub fn into_inner(self) -> T {
        self.buffer
    }

    /// Datagram length (the UDP payload length).
    pub fn len(&self) -> usize {
        self.buffer.as_ref().len()
    }

    pub fn is_empty(&self) -> bool {
        self.buffer.as_ref().is_empty()
    }

    pub fn magic(&self) -> [u8; 2] {
        let b = self.buffer.as_ref();
        [b[0], b[1]]
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[field::VERSION]
    }

    pub fn kind_raw(&self) -> u8 {
        self.buffer.as_ref()[field::KIND]
    }

    pub fn kind(&self) -> Option<Kind> {
        Kind::from_u8(self.kind_raw())
    }

    pub fn flow_id(&self) -> u64 {
        be64(&self.buffer.as_ref()[field::FLOW_ID])
    }

    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[field::FLAGS]
    }

    /// Byte 13: token length, status or SACK count, by kind.
    pub fn aux8(&self) -> u8 {
        self.buffer.as_ref()[field::AUX8]
    }

    /// Bytes 14..16: payload length or leading_fragment_len echo, by kind.
    pub fn aux16(&self) -> u16 {
        be16(&self.buffer.as_ref()[field::AUX16])
    }

    /// Bytes 16..24 (flow size, rate echo, sequence, cumulative ack, final size).
    pub fn word0(&self) -> u64 {
        be64(&self.buffer.as_ref()[field::WORD0])
    }

    /// Bytes 24..32 (timestamp or its echo).
    pub fn word1(&self) -> u64 {
        be64(&self.buffer.as_ref()[field::WORD1])
    }

    /// Bytes 32..40 of an ACK: the advertised_rate echo in bytes/s.
    pub fn ack_rate_raw(&self) -> u64 {
        be64(&self.buffer.as_ref()[field::WORD2])
    }

    /// HANDSHAKE: the token bytes.
    pub fn token(&self) -> &[u8] {
        let tl = self.aux8() as usize;
        &self.buffer.as_ref()[field::TAIL_32..field::TAIL_32 + tl]
    }

    /// DATA: the payload.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[DATA_HEADER_LEN..]
    }

    /// ACK: SACK block `i` as (start, end).
    pub fn sack_block(&self, i: usize) -> (u64, u64) {
        let o = field::SACK + i * SACK_BLOCK_LEN;
        let b = self.buffer.as_ref();
        (be64(&b[o..o + 8]), be64(&b[o + 8..o + 16]))
    }
}

fn fixed(len: usize, want: usize) -> Result<(), Error> {
    if len < want {
        Err(Error::Truncated)
    } else if len > want {
        Err(Error::BadLength)
    } else {
        Ok(())
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    fn put64(&mut self, r: core::ops::Range<usize>, v: u64) {
        self.buffer.as_mut()[r].copy_from_slice(&v.to_be_bytes());
    }

    /// Write magic, version, kind and flow id.
    pub fn set_base(&mut self, kind: Kind, flow_id: u64) {
        let b = self.buffer.as_mut();
        b[field::MAGIC].copy_from_slice(&MAGIC);
        b[field::VERSION] = VERSION;
        b[field::KIND] = kind as u8;
        self.put64(field::FLOW_ID, flow_id);
    }

    pub fn set_flags(&mut self, v: u8) {
        self.buffer.as_mut()[field::FLAGS] = v;
    }

    pub fn set_aux8(&mut self, v: u8) {
        self.buffer.as_mut()[field::AUX8] = v;
    }

    pub fn set_aux16(&mut self, v: u16) {
        self.buffer.as_mut()[field::AUX16].copy_from_slice(&v.to_be_bytes());
    }

    pub fn set_word0(&mut self, v: u64) {
        self.put64(field::WORD0, v);
    }

    pub fn set_word1(&mut self, v: u64) {
        self.put64(field::WORD1, v);
    }

    pub fn set_ack_rate_raw(&mut self, v: u64) {
        self.put64(field::WORD2, v);
    }

    /// Everything from byte 32 on (token+padding, payload, ACK tail).
    pub fn tail_mut(&mut self) -> &mut [u8] {
        &mut self.buffer.as_mut()[field::TAIL_32..]
    }

    pub fn set_sack_block(&mut self, i: usize, block: (u64, u64)) {
        let o = field::SACK + i * SACK_BLOCK_LEN;
        self.put64(o..o + 8, block.0);
        self.put64(o + 8..o + 16, block.1);
    }
}

/// Handshake outcome carried in HANDSHAKE_ACK byte 13.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    Accepted = 0,
    /// The token was missing or refused by the validator.
    BadToken = 1,
    /// The announced flow size is above the receiver's limit.
    FlowTooLarge = 2,
    /// The receiver holds its maximum number of flows.
    Busy = 3,
    /// The same peer already uses this flow id with another token or size.
    FlowIdInUse = 4,
}

impl Status {
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Accepted,
            1 => Status::BadToken,
            2 => Status::FlowTooLarge,
            3 => Status::Busy,
            4 => Status::FlowIdInUse,
            _ => return None,
        })
    }
}

/// The receiver's echo of what the router told it (paper II: "the receiver
/// uses the length to compute the sending rate and packages the computed
/// rate in the body of the next ACK").
///
/// Both raw fields are carried: `leading_fragment_len` is the observation
/// (the single source of truth, decoded by `ka_core::encoding`), and
/// `advertised_rate` (bytes per second) is the receiver's decoding of it,
/// which the sender cross-checks so a corrupt or forged echo cannot make it
/// pace at an absurd rate.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RateEcho {
    /// Leading fragment IP payload length observed before reassembly;
    /// `None` when the datagram arrived whole (wire value 0).
    pub leading_fragment_len: Option<u16>,
    /// Decoded advertised rate in bytes per second; `None` (wire 0) when no
    /// rate could be decoded.
    pub advertised_rate: Option<u64>,
}

/// Why an echo's rate is not believable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RateEchoError {
    /// A rate without a leading_fragment_len, a leading_fragment_len that
    /// decodes to nothing but comes with a rate, or a rate that is not the
    /// decoding of the length.
    Inconsistent,
}

impl fmt::Display for RateEchoError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("advertised_rate echo does not match its leading_fragment_len")
    }
}

impl RateEcho {
    /// What the receiver writes for a datagram: `None` = arrived whole.
    /// A length that is not a valid rate code (not a multiple of 8, below
    /// 24) is echoed as observed with no rate.
    pub fn observed(leading_fragment_len: Option<u16>) -> RateEcho {
        let leading_fragment_len = leading_fragment_len.filter(|&l| l != 0);
        let advertised_rate = leading_fragment_len
            .and_then(|l| encoding::advertised_rate(l as usize))
            .map(|r| (r * 1000.0).round() as u64);
        RateEcho {
            leading_fragment_len,
            advertised_rate,
        }
    }

    /// The advertised rate in bytes/ms this echo proves, if any. The rate is
    /// recomputed from `leading_fragment_len` with ka-core and must match
    /// the echoed value to the byte per second.
    pub fn validate(&self) -> Result<Option<f64>, RateEchoError> {
        let decoded = self
            .leading_fragment_len
            .and_then(|l| encoding::advertised_rate(l as usize));
        match (decoded, self.advertised_rate) {
            (None, None) => Ok(None),
            (Some(r), Some(bps)) if (r * 1000.0).round() as u64 == bps => Ok(Some(r)),
            _ => Err(RateEchoError::Inconsistent),
        }
    }

    fn lfl_raw(&self) -> u16 {
        self.leading_fragment_len.unwrap_or(0)
    }

    fn rate_raw(&self) -> u64 {
        self.advertised_rate.unwrap_or(0)
    }

    fn from_raw(lfl: u16, rate: u64) -> RateEcho {
        RateEcho {
            leading_fragment_len: (lfl != 0).then_some(lfl),
            advertised_rate: (rate != 0).then_some(rate),
        }
    }
}

/// HANDSHAKE: client -> receiver, opens a flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handshake<'a> {
    pub flow_id: u64,
    pub flow_size: u64,
    /// Client send time (ns, client clock), echoed for the first RTT sample.
    pub timestamp: u64,
    pub kickass: bool,
    /// Padded to a full-size datagram so a router can mark it.
    pub padded: bool,
    pub token: &'a [u8],
    /// Whole datagram length including zero padding.
    pub datagram_len: usize,
}

/// HANDSHAKE_ACK: receiver -> client.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HandshakeAck {
    pub flow_id: u64,
    pub status: Status,
    /// The receiver agrees to echo advertised rates.
    pub kickass: bool,
    pub rate_echo: RateEcho,
    pub ts_echo: u64,
}

/// DATA: one segment of the byte stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Data<'a> {
    pub flow_id: u64,
    /// Byte offset of the first payload byte.
    pub seq: u64,
    pub timestamp: u64,
    pub retransmission: bool,
    pub payload: &'a [u8],
}

/// Up to [`MAX_SACK_BLOCKS`] (start, end) byte ranges held beyond the
/// cumulative ack, most recent arrival first (RFC 2018).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SackBlocks {
    blocks: [(u64, u64); MAX_SACK_BLOCKS],
    len: u8,
}

impl SackBlocks {
    pub fn new() -> Self {
        Self::default()
    }

    /// Append a block; false when full.
    pub fn push(&mut self, block: (u64, u64)) -> bool {
        if self.len as usize >= MAX_SACK_BLOCKS {
            return false;
        }
        self.blocks[self.len as usize] = block;
        self.len += 1;
        true
    }

    pub fn as_slice(&self) -> &[(u64, u64)] {
        &self.blocks[..self.len as usize]
    }

    pub fn len(&self) -> usize {
        self.len as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl FromIterator<(u64, u64)> for SackBlocks {
    fn from_iter<I: IntoIterator<Item = (u64, u64)>>(iter: I) -> Self {
        let mut s = SackBlocks::new();
        for b in iter {
            if !s.push(b) {
                break;
            }
        }
        s
    }
}

/// ACK: receiver -> client, one per data datagram.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ack {
    pub flow_id: u64,
    /// Next byte expected: everything below has been delivered.
    pub cum_ack: u64,
    /// Timestamp of the data datagram that triggered this ACK.
    pub ts_echo: u64,
    /// ECN-echo for that datagram (RFC 3168).
    pub ece: bool,
    /// leading_fragment_len / advertised_rate seen on that datagram.
    pub rate_echo: RateEcho,
    pub sack: SackBlocks,
}

/// FIN (client: every byte is acknowledged, final size) and FIN_ACK
/// (receiver: confirmed, state may go).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fin {
    pub flow_id: u64,
    pub final_size: u64,
    /// Send time on FIN, echoed on FIN_ACK.
    pub timestamp: u64,
}

/// RESET: receiver -> client, "I hold no flow with this id".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reset {
    pub flow_id: u64,
    /// Sequence of the DATA (or final size of the FIN) that triggered it.
    pub seq_echo: u64,
    /// Timestamp of that datagram.
    pub ts_echo: u64,
}

/// RTT_INDICATOR: padding only; the IP length is the message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RttIndicator {
    pub flow_id: u64,
    pub datagram_len: usize,
}

/// The meaning of one datagram.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Repr<'a> {
    Handshake(Handshake<'a>),
    HandshakeAck(HandshakeAck),
    Data(Data<'a>),
    Ack(Ack),
    Fin(Fin),
    FinAck(Fin),
    RttIndicator(RttIndicator),
    Reset(Reset),
}

impl<'a> Repr<'a> {
    /// Parse a checked or unchecked view; all bounds are (re)checked here.
    pub fn parse(packet: &Packet<&'a [u8]>) -> Result<Repr<'a>, Error> {
        packet.check_len()?;
        let b: &'a [u8] = packet.buffer;
        let p = packet;
        let flow_id = p.flow_id();
        let flags = p.flags();
        // check_len accepted the kind.
        let kind = p.kind().ok_or(Error::UnknownKind(p.kind_raw()))?;
        Ok(match kind {
            Kind::Handshake => {
                let tl = p.aux8() as usize;
                Repr::Handshake(Handshake {
                    flow_id,
                    flow_size: p.word0(),
                    timestamp: p.word1(),
                    kickass: flags & FLAG_KICKASS != 0,
                    padded: flags & FLAG_PADDED != 0,
                    token: &b[field::TAIL_32..field::TAIL_32 + tl],
                    datagram_len: b.len(),
                })
            }
            Kind::HandshakeAck => Repr::HandshakeAck(HandshakeAck {
                flow_id,
                status: Status::from_u8(p.aux8()).ok_or(Error::UnknownStatus(p.aux8()))?,
                kickass: flags & FLAG_KICKASS != 0,
                rate_echo: RateEcho::from_raw(p.aux16(), p.word0()),
                ts_echo: p.word1(),
            }),
            Kind::Data => Repr::Data(Data {
                flow_id,
                seq: p.word0(),
                timestamp: p.word1(),
                retransmission: flags & FLAG_RETRANSMISSION != 0,
                payload: &b[DATA_HEADER_LEN..],
            }),
            Kind::Ack => {
                let mut sack = SackBlocks::new();
                for i in 0..p.aux8() as usize {
                    let blk = p.sack_block(i);
                    if blk.0 >= blk.1 {
                        return Err(Error::BadSackBlock);
                    }
                    sack.push(blk);
                }
                Repr::Ack(Ack {
                    flow_id,
                    cum_ack: p.word0(),
                    ts_echo: p.word1(),
                    ece: flags & FLAG_ECE != 0,
                    rate_echo: RateEcho::from_raw(p.aux16(), p.ack_rate_raw()),
                    sack,
                })
            }
            Kind::Fin | Kind::FinAck => {
                let f = Fin {
                    flow_id,
                    final_size: p.word0(),
                    timestamp: p.word1(),
                };
                if kind == Kind::Fin {
                    Repr::Fin(f)
                } else {
                    Repr::FinAck(f)
                }
            }
            Kind::RttIndicator => Repr::RttIndicator(RttIndicator {
                flow_id,
                datagram_len: b.len(),
            }),
            Kind::Reset => Repr::Reset(Reset {
                flow_id,
                seq_echo: p.word0(),
                ts_echo: p.word1(),
            }),
        })
    }

    /// Parse raw UDP payload bytes.
    pub fn parse_bytes(bytes: &'a [u8]) -> Result<Repr<'a>, Error> {
        Repr::parse(&Packet::new_unchecked(bytes))
    }

    pub fn kind(&self) -> Kind {
        match self {
            Repr::Handshake(_) => Kind::Handshake,
            Repr::HandshakeAck(_) => Kind::HandshakeAck,
            Repr::Data(_) => Kind::Data,
            Repr::Ack(_) => Kind::Ack,
            Repr::Fin(_) => Kind::Fin,
            Repr::FinAck(_) => Kind::FinAck,
            Repr::RttIndicator(_) => Kind::RttIndicator,
            Repr::Reset(_) => Kind::Reset,
        }
    }

    pub fn flow_id(&self) -> u64 {
        match self {
            Repr::Handshake(h) => h.flow_id,
            Repr::HandshakeAck(h) => h.flow_id,
            Repr::Data(d) => d.flow_id,
            Repr::Ack(a) => a.flow_id,
            Repr::Fin(f) | Repr::FinAck(f) => f.flow_id,
            Repr::RttIndicator(r) => r.flow_id,
            Repr::Reset(r) => r.flow_id,
        }
    }

    /// Bytes [`emit`](Self::emit) writes. For HANDSHAKE and RTT_INDICATOR
    /// this is the padded `datagram_len` (never less than the minimum).
    pub fn buffer_len(&self) -> usize {
        match self {
            Repr::Handshake(h) => h
                .datagram_len
                .max(MIN_HANDSHAKE_LEN)
                .max(HANDSHAKE_HEADER_LEN + h.token.len()),
            Repr::HandshakeAck(_) => HANDSHAKE_ACK_LEN,
            Repr::Data(d) => DATA_HEADER_LEN + d.payload.len(),
            Repr::Ack(a) => ACK_HEADER_LEN + a.sack.len() * SACK_BLOCK_LEN,
            Repr::Fin(_) | Repr::FinAck(_) | Repr::Reset(_) => FIN_LEN,
            Repr::RttIndicator(r) => r.datagram_len.max(MIN_RTT_INDICATOR_LEN),
        }
    }

    /// Write into a buffer of exactly [`buffer_len`](Self::buffer_len)
    /// bytes. Panics (a caller bug, never input-driven) when the buffer has
    /// the wrong size, a token is over [`MAX_TOKEN_LEN`] or a payload over
    /// 65535 bytes.
    pub fn emit<T: AsRef<[u8]> + AsMut<[u8]>>(&self, p: &mut Packet<T>) {
        assert_eq!(p.len(), self.buffer_len(), "emit buffer of the wrong size");
        p.buffer.as_mut().fill(0);
        p.set_base(self.kind(), self.flow_id());
        match self {
            Repr::Handshake(h) => {
                assert!(h.token.len() <= MAX_TOKEN_LEN, "token too long");
                let mut flags = 0;
                if h.kickass {
                    flags |= FLAG_KICKASS;
                }
                if h.padded {
                    flags |= FLAG_PADDED;
                }
                p.set_flags(flags);
                p.set_aux8(h.token.len() as u8);
                p.set_word0(h.flow_size);
                p.set_word1(h.timestamp);
                p.tail_mut()[..h.token.len()].copy_from_slice(h.token);
            }
            Repr::HandshakeAck(h) => {
                p.set_flags(if h.kickass { FLAG_KICKASS } else { 0 });
                p.set_aux8(h.status as u8);
                p.set_aux16(h.rate_echo.lfl_raw());
                p.set_word0(h.rate_echo.rate_raw());
                p.set_word1(h.ts_echo);
            }
            Repr::Data(d) => {
                let len = u16::try_from(d.payload.len()).expect("payload over 65535 bytes");
                p.set_flags(if d.retransmission {
                    FLAG_RETRANSMISSION
                } else {
                    0
                });
                p.set_aux16(len);
                p.set_word0(d.seq);
                p.set_word1(d.timestamp);
                p.tail_mut().copy_from_slice(d.payload);
            }
            Repr::Ack(a) => {
                p.set_flags(if a.ece { FLAG_ECE } else { 0 });
                p.set_aux8(a.sack.len() as u8);
                p.set_aux16(a.rate_echo.lfl_raw());
                p.set_word0(a.cum_ack);
                p.set_word1(a.ts_echo);
                p.set_ack_rate_raw(a.rate_echo.rate_raw());
                for (i, blk) in a.sack.as_slice().iter().enumerate() {
                    p.set_sack_block(i, *blk);
                }
            }
            Repr::Fin(f) | Repr::FinAck(f) => {
                p.set_word0(f.final_size);
                p.set_word1(f.timestamp);
            }
            Repr::RttIndicator(_) => {}
            Repr::Reset(r) => {
                p.set_word0(r.seq_echo);
                p.set_word1(r.ts_echo);
            }
        }
    }

    /// Emit into `buf`, replacing its contents.
    pub fn emit_into(&self, buf: &mut Vec<u8>) {
        buf.clear();
        buf.resize(self.buffer_len(), 0);
        self.emit(&mut Packet::new_unchecked(&mut buf[..]));
    }

    pub fn to_vec(&self) -> Vec<u8> {
        let mut v = Vec::new();
        self.emit_into(&mut v);
        v
    }
}

/// UDP payload length of the RTT indicator for `rtt_ms`: sent with DF set,
/// its IP total length is exactly `ka_core::encoding::rtt_indicator(rtt_ms)`
/// (600..611, paper II-B).
pub fn rtt_indicator_payload_len(rtt_ms: f64) -> usize {
    encoding::rtt_indicator(rtt_ms) - IP_UDP_OVERHEAD
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        let s: String = s.split_whitespace().collect();
        (0..s.len())
            .step_by(2)
            .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex"))
            .collect()
    }

    /// Real datagrams, byte for byte, and what they mean.
    #[test]
    fn table_of_real_bytes_round_trips() {
        let token = b"tok";
        let mut hs =
            hex("4b41 01 01 0102030405060708 03 03 0000 00000000000005a0 000000003b9aca00 746f6b");
        hs.resize(64, 0);
        let data_bytes =
            hex("4b41 01 03 0000000000000009 01 00 0002 0000000000000b40 0000000000000064 abcd");
        let cases: Vec<(Vec<u8>, Repr)> = vec![
            (
                hs.clone(),
                Repr::Handshake(Handshake {
                    flow_id: 0x0102_0304_0506_0708,
                    flow_size: 1440,
                    timestamp: 1_000_000_000,
                    kickass: true,
                    padded: true,
                    token,
                    datagram_len: 64,
                }),
            ),
            (
                // leading_fragment_len 584 = 0x248 advertises 1191.96 B/ms.
                hex("4b41 01 02 0102030405060708 01 00 0248 0000000000123016 000000003b9aca00"),
                Repr::HandshakeAck(HandshakeAck {
                    flow_id: 0x0102_0304_0506_0708,
                    status: Status::Accepted,
                    kickass: true,
                    rate_echo: RateEcho::observed(Some(584)),
                    ts_echo: 1_000_000_000,
                }),
            ),
            (
                data_bytes.clone(),
                Repr::Data(Data {
                    flow_id: 9,
                    seq: 2880,
                    timestamp: 100,
                    retransmission: true,
                    payload: &[0xab, 0xcd],
                }),
            ),
            (
                hex(
                    "4b41 01 04 0000000000000009 01 02 0000 0000000000000b40 0000000000000064 0000000000000000 \
                     0000000000000fa0 0000000000001540 0000000000001b80 0000000000002120",
                ),
                Repr::Ack(Ack {
                    flow_id: 9,
                    cum_ack: 2880,
                    ts_echo: 100,
                    ece: true,
                    rate_echo: RateEcho::observed(None),
                    sack: [(4000, 5440), (7040, 8480)].into_iter().collect(),
                }),
            ),
            (
                hex("4b41 01 05 0000000000000009 00 00 0000 0000000000002120 00000000000000c8"),
                Repr::Fin(Fin {
                    flow_id: 9,
                    final_size: 8480,
                    timestamp: 200,
                }),
            ),
            (
                hex("4b41 01 06 0000000000000009 00 00 0000 0000000000002120 00000000000000c8"),
                Repr::FinAck(Fin {
                    flow_id: 9,
                    final_size: 8480,
                    timestamp: 200,
                }),
            ),
            (
                hex("4b41 01 08 0000000000000009 00 00 0000 0000000000000b40 0000000000000064"),
                Repr::Reset(Reset {
                    flow_id: 9,
                    seq_echo: 2880,
                    ts_echo: 100,
                }),
            ),
            (
                hex("4b41 01 07 0000000000000009 00 00 0000 0000"),
                Repr::RttIndicator(RttIndicator {
                    flow_id: 9,
                    datagram_len: 18,
                }),
            ),
        ];
        for (bytes, repr) in &cases {
            let parsed = Repr::parse_bytes(bytes).expect("parses");
            assert_eq!(&parsed, repr);
            assert_eq!(&repr.to_vec(), bytes, "{:?}", repr.kind());
        }
        // 584 = floor8(F(10 Mbit/s)); its decoding is 1191.96 B/ms.
        assert_eq!(
            RateEcho::observed(Some(584)).advertised_rate,
            Some(0x12_3016)
        );
        assert_eq!(
            RateEcho::observed(Some(584)).validate(),
            Ok(encoding::advertised_rate(584))
        );
    }

    #[test]
    fn full_size_data_is_exactly_1500_ip_bytes() {
        let payload = [0u8; MAX_DATA_PAYLOAD];
        let d = Repr::Data(Data {
            flow_id: 1,
            seq: 0,
            timestamp: 0,
            retransmission: false,
            payload: &payload,
        });
        assert_eq!(MAX_DATA_PAYLOAD, 1440);
        assert_eq!(d.buffer_len() + IP_UDP_OVERHEAD, encoding::FULL_PACKET_LEN);
    }

    #[test]
    fn rtt_indicator_lengths() {
        assert_eq!(rtt_indicator_payload_len(1.0) + IP_UDP_OVERHEAD, 600);
        assert_eq!(rtt_indicator_payload_len(100.0) + IP_UDP_OVERHEAD, 606);
        assert_eq!(rtt_indicator_payload_len(1e6) + IP_UDP_OVERHEAD, 611);
        for ms in [0.5, 3.0, 50.0, 100.0, 2000.0, 5000.0] {
            let ip = rtt_indicator_payload_len(ms) + IP_UDP_OVERHEAD;
            assert!(encoding::is_rtt_indicator(ip, true));
            assert_eq!(ip, encoding::rtt_indicator(ms));
        }
    }

    #[test]
    fn hostile_bytes_are_clear_errors() {
        let ok = hex("4b41 01 05 0000000000000009 00 00 0000 0000000000002120 00000000000000c8");
        assert_eq!(Repr::parse_bytes(&[]), Err(Error::Truncated));
        assert_eq!(Repr::parse_bytes(&ok[..15]), Err(Error::Truncated));
        let mut b = ok.clone();
        b[0] = b'X';
        assert_eq!(Repr::parse_bytes(&b), Err(Error::BadMagic));
        let mut b = ok.clone();
        b[2] = 9;
        assert_eq!(Repr::parse_bytes(&b), Err(Error::UnsupportedVersion(9)));
        let mut b = ok.clone();
        b[3] = 99;
        assert_eq!(Repr::parse_bytes(&b), Err(Error::UnknownKind(99)));
        let mut b = ok.clone();
        b.push(0);
        assert_eq!(Repr::parse_bytes(&b), Err(Error::BadLength));
        // DATA whose payload length lies.
        let mut d =
            hex("4b41 01 03 0000000000000009 00 00 0005 0000000000000000 0000000000000000 ab");
        assert_eq!(Repr::parse_bytes(&d), Err(Error::BadLength));
        d[15] = 1;
        assert!(Repr::parse_bytes(&d).is_ok());
        // Handshake too short for the anti-amplification rule.
        let short = hex("4b41 01 01 0000000000000009 00 00 0000 0000000000000001 0000000000000000");
        assert_eq!(Repr::parse_bytes(&short), Err(Error::HandshakeTooShort));
        let mut long_token = short.clone();
        long_token[13] = 65;
        long_token.resize(200, 0);
        assert_eq!(Repr::parse_bytes(&long_token), Err(Error::TokenTooLong));
        let mut lying_token = short.clone();
        lying_token[13] = 40;
        lying_token.resize(64, 0);
        assert_eq!(Repr::parse_bytes(&lying_token), Err(Error::BadLength));
        // ACK with a reversed SACK block / too many blocks / unknown status.
        let mut a = hex(
            "4b41 01 04 0000000000000009 00 01 0000 0000000000000000 0000000000000000 0000000000000000 \
             0000000000000010 0000000000000008",
        );
        assert_eq!(Repr::parse_bytes(&a), Err(Error::BadSackBlock));
        a[13] = 5;
        assert_eq!(Repr::parse_bytes(&a), Err(Error::TooManySackBlocks));
        let hsa = hex("4b41 01 02 0102030405060708 00 07 0000 0000000000000000 0000000000000000");
        assert_eq!(Repr::parse_bytes(&hsa), Err(Error::UnknownStatus(7)));
    }

    #[test]
    fn rate_echo_validation() {
        assert_eq!(RateEcho::observed(None).validate(), Ok(None));
        // A length that is no rate code: echoed, no rate, not an error.
        let odd = RateEcho::observed(Some(16));
        assert_eq!(odd.leading_fragment_len, Some(16));
        assert_eq!(odd.validate(), Ok(None));
        // Forged: rate without length, absurd rate, length 7 with a rate.
        for bad in [
            RateEcho {
                leading_fragment_len: None,
                advertised_rate: Some(1),
            },
            RateEcho {
                leading_fragment_len: Some(584),
                advertised_rate: Some(u64::MAX),
            },
            RateEcho {
                leading_fragment_len: Some(7),
                advertised_rate: Some(1_191_958),
            },
            RateEcho {
                leading_fragment_len: Some(2000),
                advertised_rate: Some(1_000_000_000_000),
            },
        ] {
            assert_eq!(bad.validate(), Err(RateEchoError::Inconsistent), "{bad:?}");
        }
    }
}
