//! The fragment tap: an AF_PACKET socket (SOCK_DGRAM, ETH_P_IP, so each
//! packet starts at its IP header) that sees our datagrams' fragments
//! before the kernel reassembles them, behind a classic BPF filter run in
//! the kernel so that only the few packets that matter are copied:
//!
//! * IPv4, UDP;
//! * a leading fragment (MF set, offset 0) whose UDP destination port is
//!   ours, or
//! * a non-leading fragment with offset below 40 bytes (it carries the
//!   rest of the key when a leading fragment is shorter, see `fragments`);
//!
//! each cut to [`SNAP_LEN`] bytes. Datagrams that arrive whole never leave
//! the kernel twice. The socket is created unbound, the filter attached,
//! and only then bound to ETH_P_IP, so no unfiltered packet is ever queued.

use std::io;
use std::os::fd::RawFd;

use crate::fragments::KEY_SPAN;
pub use crate::sys::packet::Insn;
use crate::sys::{grow_buffer, packet, Error, Fd, Result};

/// Bytes kept of each captured packet: the longest IPv4 header (60) and
/// the key span (40) fit.
pub const SNAP_LEN: u32 = 128;

// Classic BPF opcodes (linux/filter.h).
const LD_B_ABS: u16 = 0x30;
const LD_H_ABS: u16 = 0x28;
const LD_H_IND: u16 = 0x48;
const LDX_B_MSH: u16 = 0xb1;
const ALU_AND_K: u16 = 0x54;
const JEQ_K: u16 = 0x15;
const JGE_K: u16 = 0x35;
const JSET_K: u16 = 0x45;
const RET_K: u16 = 0x06;

const fn insn(code: u16, jt: u8, jf: u8, k: u32) -> Insn {
    Insn { code, jt, jf, k }
}

/// The filter for UDP port `port`; offsets count from the IP header.
pub fn fragment_filter(port: u16) -> Vec<Insn> {
    // Jump offsets are relative to the next instruction.
    const ACCEPT: u8 = 13;
    const DROP: u8 = 14;
    let to = |from: u8, target: u8| target - from - 1;
    vec![
        /* 0 */ insn(LD_B_ABS, 0, 0, 0),
        /* 1 */ insn(ALU_AND_K, 0, 0, 0xf0),
        /* 2 */ insn(JEQ_K, 0, to(2, DROP), 0x40), // IPv4
        /* 3 */ insn(LD_B_ABS, 0, 0, 9),
        /* 4 */ insn(JEQ_K, 0, to(4, DROP), 17), // UDP
        /* 5 */ insn(LD_H_ABS, 0, 0, 6),
        /* 6 */ insn(JSET_K, to(6, 11), 0, 0x1fff), // offset != 0: a later piece
        /* 7 */ insn(JSET_K, 0, to(7, DROP), 0x2000), // MF: a leading fragment
        /* 8 */ insn(LDX_B_MSH, 0, 0, 0), // X = IHL * 4
        /* 9 */ insn(LD_H_IND, 0, 0, 2), // UDP destination port
        /* 10 */ insn(JEQ_K, to(10, ACCEPT), to(10, DROP), port as u32),
        /* 11 */ insn(ALU_AND_K, 0, 0, 0x1fff),
        /* 12 */ insn(JGE_K, to(12, DROP), to(12, ACCEPT), (KEY_SPAN / 8) as u32),
        /* 13 */ insn(RET_K, 0, 0, SNAP_LEN),
        /* 14 */ insn(RET_K, 0, 0, 0),
    ]
}

/// Counters the kernel keeps for the socket (PACKET_STATISTICS).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct TapStats {
    /// Packets that passed the filter.
    pub packets: u64,
    /// ... of which dropped because the receive buffer was full: their
    /// datagrams look as if they had arrived whole.
    pub drops: u64,
}

pub struct FragmentTap {
    fd: Fd,
    stats: TapStats,
}

fn permission_hint(e: &io::Error) -> Option<Error> {
    matches!(e.raw_os_error(), Some(libc::EPERM) | Some(libc::EACCES)).then(|| {
        Error::new(format!(
            "cannot open the AF_PACKET socket that reads leading fragments: {e}"
        ))
        .hint(
            "reading fragments before reassembly needs CAP_NET_RAW: run as root, or \
             `setcap cap_net_raw+ep ka-agent-recv`, or pass --no-leading-fragments \
             (every flow then runs as TCP: no rate can be read)",
        )
    })
}

impl FragmentTap {
    /// Open the tap for UDP `port`, on `ifindex` (None: every interface).
    pub fn open(port: u16, ifindex: Option<u32>) -> Result<FragmentTap> {
        // Protocol 0: receives nothing until bound below.
        let fd = packet::open(libc::SOCK_DGRAM, 0).map_err(|e| {
            permission_hint(&e)
                .unwrap_or_else(|| Error::new(format!("cannot open an AF_PACKET socket: {e}")))
        })?;
        packet::attach_filter(fd.0, &fragment_filter(port))
            .map_err(|e| Error::new(format!("cannot attach the fragment filter (BPF): {e}")))?;
        // PACKET_OUTGOING is filtered in `recv` too.
        packet::ignore_outgoing(fd.0);
        grow_buffer(fd.0, true, 8 << 20);
        let eth_ip = libc::ETH_P_IP as u16;
        packet::bind(fd.0, eth_ip, ifindex.unwrap_or(0) as i32).map_err(|e| {
            permission_hint(&e)
                .unwrap_or_else(|| Error::new(format!("cannot bind the AF_PACKET socket: {e}")))
        })?;
        Ok(FragmentTap {
            fd,
            stats: TapStats::default(),
        })
    }

    pub fn fd(&self) -> RawFd {
        self.fd.0
    }

    /// The next captured packet (from its IP header), skipping our own
    /// transmissions; Ok(None) when nothing is waiting.
    pub fn recv(&self, buf: &mut [u8]) -> io::Result<Option<usize>> {
        packet::recv_incoming(self.fd.0, buf, 0)
    }

    /// Cumulative kernel counters (the kernel resets them on each read).
    pub fn stats(&mut self) -> TapStats {
        if let Ok(st) = packet::statistics(self.fd.0) {
            self.stats.packets += st.tp_packets as u64;
            self.stats.drops += st.tp_drops as u64;
        }
        self.stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A classic BPF interpreter for the opcodes the filter uses: the
    /// program is checked against real packet bytes without a kernel.
    fn run(prog: &[Insn], pkt: &[u8]) -> u32 {
        let (mut a, mut x, mut pc) = (0u32, 0u32, 0usize);
        let ld = |off: usize, n: usize| -> Option<u32> {
            pkt.get(off..off + n)
                .map(|b| b.iter().fold(0u32, |acc, &v| acc << 8 | v as u32))
        };
        loop {
            let i = prog[pc];
            pc += 1;
            let jump = |cond: bool| if cond { i.jt as usize } else { i.jf as usize };
            match i.code {
                LD_B_ABS => match ld(i.k as usize, 1) {
                    Some(v) => a = v,
                    None => return 0,
                },
                LD_H_ABS => match ld(i.k as usize, 2) {
                    Some(v) => a = v,
                    None => return 0,
                },
                LD_H_IND => match ld(x as usize + i.k as usize, 2) {
                    Some(v) => a = v,
                    None => return 0,
                },
                LDX_B_MSH => match ld(i.k as usize, 1) {
                    Some(v) => x = (v & 0xf) * 4,
                    None => return 0,
                },
                ALU_AND_K => a &= i.k,
                JEQ_K => pc += jump(a == i.k),
                JGE_K => pc += jump(a >= i.k),
                JSET_K => pc += jump(a & i.k != 0),
                RET_K => return i.k,
                c => panic!("opcode {c:#x} not interpreted"),
            }
        }
    }

    fn ip(proto: u8, frag: u16, dport: u16, ihl_words: u8) -> Vec<u8> {
        let ihl = ihl_words as usize * 4;
        let mut p = vec![0u8; ihl + 40];
        p[0] = 0x40 | ihl_words;
        let total = p.len() as u16;
        p[2..4].copy_from_slice(&total.to_be_bytes());
        p[6..8].copy_from_slice(&frag.to_be_bytes());
        p[9] = proto;
        p[ihl + 2..ihl + 4].copy_from_slice(&dport.to_be_bytes());
        p
    }

    #[test]
    fn filter_takes_exactly_our_leading_fragments_and_early_pieces() {
        let f = fragment_filter(7000);
        assert_eq!(f.len(), 15);
        let mf = 0x2000;
        // Leading fragment to our port, with and without IP options.
        assert_eq!(run(&f, &ip(17, mf, 7000, 5)), SNAP_LEN);
        assert_eq!(run(&f, &ip(17, mf, 7000, 15)), SNAP_LEN);
        // Another port, a whole datagram (to us or not), TCP, DF only.
        assert_eq!(run(&f, &ip(17, mf, 7001, 5)), 0);
        assert_eq!(run(&f, &ip(17, 0, 7000, 5)), 0);
        assert_eq!(run(&f, &ip(17, 0x4000, 7000, 5)), 0);
        assert_eq!(run(&f, &ip(6, mf, 7000, 5)), 0);
        // Later pieces: offsets 8..32 bytes (units 1..4) pass, 40 and beyond not.
        for units in 1..=4u16 {
            assert_eq!(run(&f, &ip(17, units, 1, 5)), SNAP_LEN, "offset {units}");
            assert_eq!(run(&f, &ip(17, units | mf, 1, 5)), SNAP_LEN);
        }
        assert_eq!(run(&f, &ip(17, 5, 7000, 5)), 0);
        assert_eq!(run(&f, &ip(17, 73 | mf, 7000, 5)), 0);
        // IPv6 and truncated input.
        let mut v6 = ip(17, mf, 7000, 5);
        v6[0] = 0x60;
        assert_eq!(run(&f, &v6), 0);
        assert_eq!(run(&f, &ip(17, mf, 7000, 5)[..21]), 0);
    }
}
