//! Drive a [`Connection`] by hand: the test plays network and receiver,
//! crafting every HANDSHAKE_ACK and ACK, so each RFC / paper rule can be
//! checked at the exact ACK where it must fire.

use ka_core::Nanos;
use ka_transport::wire::{Ack, HandshakeAck, Kind, RateEcho, Repr, SackBlocks, Status};
use ka_transport::{Config, Connection, DatagramError, Event, Payload, RttIndicatorClock, SMSS};

use super::{MS, TOKEN};

pub const FLOW: u64 = 0x1234;
/// floor8(F(10 Mbit/s)): advertises 1191.96 B/ms.
pub const L_10MBIT: u16 = 584;

/// A DATA datagram the connection sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sent {
    pub seq: u64,
    pub len: u64,
    pub ts: u64,
    pub retransmission: bool,
    pub df: bool,
    /// This segment carried the endpoint's RTT indicator (cut to its length, DF set).
    pub indicator: bool,
}

pub struct Manual {
    pub conn: Connection,
    pub now: Nanos,
    pub events: Vec<Event>,
    /// IP lengths of the RTT indicators sent (standalone or carried by data).
    pub indicators: Vec<usize>,
    /// The endpoint's indicator clock (this flow is the endpoint's only
    /// one); `None` (the default) sends no indicators, so that segments
    /// keep whole SMSS boundaries in tests of other rules.
    pub clock: Option<RttIndicatorClock>,
    buf: Vec<u8>,
}

impl Manual {
    pub fn new(cfg: Config, size: u64) -> Self {
        let conn = Connection::new(cfg, FLOW, TOKEN.to_vec(), Payload::Pattern { len: size }, 0)
            .expect("valid");
        Manual {
            conn,
            now: 0,
            events: Vec::new(),
            indicators: Vec::new(),
            clock: None,
            buf: Vec::new(),
        }
    }

    /// Send the HANDSHAKE at t=0 and answer it `rtt` later, echoing
    /// `lfl` as the leading fragment the receiver saw.
    pub fn connect(cfg: Config, size: u64, rtt: Nanos, lfl: Option<u16>) -> Self {
        let mut m = Manual::new(cfg, size);
        let t = m.conn.poll_transmit(0, &mut m.buf).expect("handshake");
        assert_eq!(t.kind, Kind::Handshake);
        let Ok(Repr::Handshake(h)) = Repr::parse_bytes(&m.buf[..t.len]) else {
            panic!("not a handshake");
        };
        let (ts, ka) = (h.timestamp, h.kickass);
        m.now = rtt;
        let ack = Repr::HandshakeAck(HandshakeAck {
            flow_id: FLOW,
            status: Status::Accepted,
            kickass: ka,
            rate_echo: RateEcho::observed(lfl),
            ts_echo: ts,
        })
        .to_vec();
        m.conn.handle_datagram(m.now, &ack).expect("accepted");
        m.drain_events();
        m
    }

    /// Send the endpoint's RTT indicators too (paper II-B).
    pub fn with_indicators(mut self) -> Self {
        self.clock = Some(RttIndicatorClock::default());
        self
    }

    pub fn drain_events(&mut self) {
        while let Some(e) = self.conn.poll_event() {
            self.events.push(e);
        }
    }

    /// Everything sendable at the current time, the endpoint's RTT
    /// indicator first when it is due (its IP length is collected aside).
    pub fn send_now(&mut self) -> Vec<Sent> {
        let mut out = Vec::new();
        loop {
            let indicator = match self.clock.as_mut() {
                Some(c) => c.poll(self.now, [&mut self.conn], &mut self.buf),
                None => None,
            };
            let t = match indicator {
                Some((_, t)) => t,
                None => match self.conn.poll_transmit(self.now, &mut self.buf) {
                    Some(t) => t,
                    None => break,
                },
            };
            if t.rtt_indicator {
                self.indicators.push(t.ip_len());
            }
            match Repr::parse_bytes(&self.buf[..t.len]).expect("own datagram parses") {
                Repr::Data(d) => out.push(Sent {
                    seq: d.seq,
                    len: d.payload.len() as u64,
                    ts: d.timestamp,
                    retransmission: d.retransmission,
                    df: t.dont_fragment,
                    indicator: t.rtt_indicator,
                }),
                Repr::RttIndicator(_) => {}
                Repr::Fin(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
        self.drain_events();
        out
    }

    /// Send until the window (not the pacer) stops us, letting simulated
    /// time run through pacer waits.
    pub fn fill_window(&mut self) -> Vec<Sent> {
        let mut out = Vec::new();
        loop {
            out.extend(self.send_now());
            let flight = self.conn.flight_size();
            let window = self.conn.window();
            let more = self.conn.snd_nxt() < self.conn.size();
            if !more || flight + SMSS > window {
                return out;
            }
            match self.next_timeout() {
                Some(t) if t > self.now => self.advance_to(t),
                _ => return out,
            }
        }
    }

    /// The connection's next deadline, or the indicator clock's when a flow
    /// can carry it.
    pub fn next_timeout(&self) -> Option<Nanos> {
        let c = self.conn.poll_timeout();
        let i = self
            .clock
            .as_ref()
            .and_then(|c| c.poll_timeout([&self.conn]));
        match (c, i) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    pub fn advance_to(&mut self, t: Nanos) {
        self.now = self.now.max(t);
        if self.conn.poll_timeout().is_some_and(|d| d <= self.now) {
            self.conn.handle_timeout(self.now);
        }
        self.drain_events();
    }

    pub fn advance(&mut self, dt: Nanos) {
        self.advance_to(self.now + dt);
    }

    /// Deliver an ACK.
    pub fn ack_full(
        &mut self,
        cum: u64,
        sack: &[(u64, u64)],
        ts_echo: u64,
        rate_echo: RateEcho,
        ece: bool,
    ) -> Result<(), DatagramError> {
        let a = Repr::Ack(Ack {
            flow_id: FLOW,
            cum_ack: cum,
            ts_echo,
            ece,
            rate_echo,
            sack: sack.iter().copied().collect::<SackBlocks>(),
        })
        .to_vec();
        let r = self.conn.handle_datagram(self.now, &a);
        self.drain_events();
        r
    }

    /// An ACK for the datagram sent at `ts`, with the observed leading
    /// fragment `lfl` (None: arrived whole).
    pub fn ack(&mut self, cum: u64, sack: &[(u64, u64)], ts: u64, lfl: Option<u16>) {
        self.ack_full(cum, sack, ts, RateEcho::observed(lfl), false)
            .expect("valid ack");
    }

    pub fn switches(&self) -> Vec<ka_transport::ModeSwitch> {
        self.events
            .iter()
            .filter_map(|e| match e {
                Event::ModeSwitched(s) => Some(*s),
                _ => None,
            })
            .collect()
    }
}

pub fn ms(x: u64) -> Nanos {
    x * MS
}
