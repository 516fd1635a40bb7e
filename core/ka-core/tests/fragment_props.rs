//! Property tests of the fragmenter over random IPv4 packets: reassembly
//! (by our RFC 791 oracle and by etherparse's defragmenter) gives back the
//! original bytes, the leading fragment carries exactly floor8(F(R)), and
//! everything that must pass leaves byte-identical.

use core::net::Ipv4Addr;

use etherparse::defrag::IpDefragPool;
use etherparse::SlicedPacket;
use ka_core::encoding;
use ka_core::fragment::{self, Pass, Verdict};
use ka_core::router::{Router, RouterConfig};
use ka_core::wire::ipv4::{Packet, Repr};
use proptest::prelude::*;

/// Well-formed option areas: a mix of copied and non-copied options with
/// valid lengths, NOPs, END padding, up to 40 bytes.
fn options() -> impl Strategy<Value = Vec<u8>> {
    let one = prop_oneof![
        Just(vec![1u8]),                    // NOP
        Just(vec![0x94, 0x04, 0x00, 0x00]), // router alert (copied)
        (2usize..=10).prop_map(|n| {
            let mut v = vec![0x44, (4 + n) as u8, 5, 0]; // timestamp (not copied)
            v.extend(std::iter::repeat_n(0u8, n));
            v
        }),
        (0usize..=6).prop_map(|n| {
            let mut v = vec![0x83, (3 + n) as u8, 4]; // LSRR (copied)
            v.extend(std::iter::repeat_n(7u8, n));
            v
        }),
        proptest::collection::vec(any::<u8>(), 1..8), // garbage: Linux leaves it
    ];
    proptest::collection::vec(one, 0..5).prop_map(|parts| {
        let mut v: Vec<u8> = parts.concat();
        v.truncate(40);
        while v.len() % 4 != 0 {
            v.push(0); // END
        }
        v
    })
}

#[derive(Debug, Clone)]
struct Case {
    packet: Vec<u8>,
    rate_bytes_per_ms: f64,
}

fn case() -> impl Strategy<Value = Case> {
    (
        options(),
        any::<u16>(),
        any::<u8>(),
        any::<u8>(),
        1u8..=255,
        any::<bool>(),
        prop_oneof![3 => Just(0usize), 1 => (1usize..100).prop_map(|x| x * 8)],
        prop_oneof![4 => Just(false), 1 => Just(true)],
        prop_oneof![6 => Just(1500usize), 1 => 60usize..1500, 1 => 1501usize..2000],
        any::<u64>(),
        // Rates from below the encodable minimum up to 10 Gbit/s.
        (1.0f64..7.0).prop_map(|e| 10f64.powf(e)),
    )
        .prop_map(
            |(options, ident, tos, protocol, ttl, mf, offset, df, total, seed, rate)| {
                let hl = 20 + options.len();
                let total = total.max(hl + 8);
                let mut x = seed;
                let payload: Vec<u8> = (0..total - hl)
                    .map(|_| {
                        x = x
                            .wrapping_mul(6364136223846793005)
                            .wrapping_add(1442695040888963407);
                        (x >> 56) as u8
                    })
                    .collect();
                let repr = Repr {
                    src_addr: Ipv4Addr::new(198, 18, 1, 2),
                    dst_addr: Ipv4Addr::new(198, 18, 2, 2),
                    protocol,
                    ttl,
                    tos,
                    ident,
                    dont_frag: df,
                    more_frags: mf,
                    frag_offset: offset,
                    options,
                    payload_len: total - hl,
                };
                Case {
                    packet: repr.to_bytes(&payload),
                    rate_bytes_per_ms: rate,
                }
            },
        )
}

fn etherparse_payload(fragments: &[Vec<u8>]) -> Option<Vec<u8>> {
    let mut pool: IpDefragPool<(), ()> = IpDefragPool::new();
    let mut out = None;
    for f in fragments {
        let sliced = SlicedPacket::from_ip(f).ok()?;
        if let Some(done) = pool.process_sliced_packet(&sliced, (), ()).ok()? {
            out = Some(done.payload);
        }
    }
    out
}

proptest! {
    // No regression files in the repository: a failure prints its minimal case.
    #![proptest_config(ProptestConfig { cases: 2000, failure_persistence: None, ..ProptestConfig::default() })]

    #[test]
    fn cut_packets_reassemble_to_the_original(c in case()) {
        let l = encoding::leading_fragment_len(c.rate_bytes_per_ms);
        let p = Packet::new_checked(&c.packet[..]).expect("well-formed");
        match fragment::classify(&c.packet, l) {
            Verdict::Cut { leading_fragment_len } => {
                // Only DF-clear packets with offset 0 that are full-size or
                // already leading fragments longer than L are cut.
                prop_assert!(!p.dont_frag() && p.frag_offset() == 0);
                prop_assert!(p.total_len() == 1500 || p.more_frags());
                let want = (encoding::leading_fragment_len_exact(c.rate_bytes_per_ms) / 8.0 + 1e-9).floor() as usize * 8;
                prop_assert_eq!(Some(leading_fragment_len), l);
                prop_assert_eq!(leading_fragment_len, want.min(1480));
                let s = fragment::split(&c.packet, leading_fragment_len).expect("cut");
                let frags = s.to_packets(&c.packet);
                let a = Packet::new_checked(&frags[0][..]).expect("lead");
                let b = Packet::new_checked(&frags[1][..]).expect("rest");
                prop_assert_eq!(a.payload_len(), leading_fragment_len);
                prop_assert!(a.more_frags() && a.frag_offset() == 0);
                prop_assert_eq!(b.frag_offset(), leading_fragment_len);
                prop_assert_eq!(b.more_frags(), p.more_frags());
                prop_assert!(a.verify_checksum() && b.verify_checksum());
                prop_assert!(!a.dont_frag() && !b.dont_frag());
                prop_assert_eq!(a.ident(), p.ident());
                prop_assert_eq!(b.ident(), p.ident());
                prop_assert_eq!(a.header_len(), p.header_len());
                prop_assert_eq!(b.header_len(), p.header_len());
                prop_assert_eq!(a.header()[20..].to_vec(), p.options().to_vec());
                prop_assert_eq!(s.wire_len(), p.total_len() as usize + p.header_len());
                // Our RFC 791 oracle gives back every byte, in either order.
                prop_assert_eq!(fragment::reassemble(&frags), Some(c.packet.clone()));
                let rev = [frags[1].clone(), frags[0].clone()];
                prop_assert_eq!(fragment::reassemble(&rev), Some(c.packet.clone()));
                // An independent defragmenter agrees on the payload (whole
                // datagrams only: it waits for the last piece; and not AH,
                // protocol 51, which etherparse parses as an extension
                // header inside the payload).
                if !p.more_frags() && p.protocol() != 51 {
                    prop_assert_eq!(etherparse_payload(&frags), Some(p.payload().to_vec()));
                }
            }
            Verdict::Pass(why) => {
                match why {
                    Pass::DontFragment => prop_assert!(p.dont_frag()),
                    Pass::NotMarking => prop_assert!(l.is_none()),
                    Pass::NonLeadingFragment => prop_assert!(p.frag_offset() > 0),
                    Pass::NotFullSize => prop_assert!(p.total_len() != 1500 && !p.more_frags()),
                    Pass::LeadingFragmentShortEnough | Pass::PayloadShortEnough => {
                        prop_assert!(p.payload_len() <= l.expect("marking"))
                    }
                    Pass::NotIpv4 => prop_assert!(false, "well-formed packet read as not IPv4"),
                }
            }
        }
    }

    #[test]
    fn df_short_and_tail_packets_leave_byte_identical(c in case()) {
        // Through the whole router core with a frozen rate.
        let mut cfg = RouterConfig::with_capacity(10e9);
        cfg.alpha = 0.0;
        cfg.beta = 0.0;
        cfg.initial_rate_bps = c.rate_bytes_per_ms * 8000.0;
        let mut r = Router::new(cfg, 0);
        r.on_packet(0, c.packet.clone()).expect("room");
        let t = r.poll_transmit(0).expect("ready");
        let p = Packet::new_checked(&c.packet[..]).expect("well-formed");
        let must_pass = p.dont_frag()
            || p.frag_offset() > 0
            || (p.total_len() != 1500 && !p.more_frags())
            || r.leading_fragment_len().is_none();
        if must_pass {
            prop_assert!(t.split.is_none());
            prop_assert_eq!(&t.packet, &c.packet);
        }
        match t.split {
            Some(s) => prop_assert_eq!(fragment::reassemble(&s.to_packets(&t.packet)), Some(c.packet.clone())),
            None => prop_assert_eq!(t.packet, c.packet),
        }
    }

    #[test]
    fn leading_fragment_len_is_floor8_of_f(r in 0.0f64..2e6) {
        let exact = encoding::leading_fragment_len_exact(r);
        match encoding::leading_fragment_len(r) {
            None => prop_assert!(exact < 24.0 + 1e-6),
            Some(l) => {
                prop_assert_eq!(l % 8, 0);
                prop_assert!((24..=1480).contains(&l));
                prop_assert!(l as f64 <= exact + 1e-6);
                prop_assert!(l == 1480 || exact < (l + 8) as f64);
                // Never advertises more than computed.
                prop_assert!(encoding::advertised_rate(l).expect("valid") <= r * (1.0 + 1e-9));
            }
        }
    }
}
