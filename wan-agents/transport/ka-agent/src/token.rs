//! Per-flow tokens, checked by the agent's Kick-Ass receiver: the same
//! bytes as the Python agent's `kickass_wan.token` (pinned by
//! `wan-agents/vectors/flow_token.json`).
//!
//! Layout (30 bytes): version u8 = 1 | kind u8 (1 kickass, 2 tcp) |
//! expires u32 BE (unix seconds) | nonce 8 |
//! mac16 = HMAC-SHA256(secret, b"kickass-flow-token" || first 14 bytes)[:16].
//!
//! [`verify`] checks length, version and MAC (constant time); the
//! [`ReplayGuard`] adds the receiver's policy: kind must be Kick-Ass, not
//! expired by the wall clock, and each nonce accepted once, remembered in
//! memory and optionally appended to a state file ("nonce_hex:expires\n",
//! the Python guard's format) so a restart does not let a replay in.

use std::collections::HashMap;
use std::fmt;
use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

use hmac::{Hmac, Mac};
use ka_transport::{TokenRequest, TokenValidator};
use sha2::Sha256;

pub const VERSION: u8 = 1;
pub const KIND_KICKASS: u8 = 1;
pub const KIND_TCP: u8 = 2;
pub const TOKEN_LEN: usize = 30;
const HEAD_LEN: usize = 14;
const LABEL: &[u8] = b"kickass-flow-token";

/// A token whose MAC checked out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowToken {
    pub kind: u8,
    pub expires: u32,
    pub nonce: [u8; 8],
}

fn mac_for(secret: &[u8], head: &[u8]) -> Hmac<Sha256> {
    // HMAC takes keys of any length: this cannot fail.
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(secret).expect("HMAC accepts any key");
    m.update(LABEL);
    m.update(head);
    m
}

/// The token bytes for `t` under `secret` (tests and tools).
pub fn encode(secret: &[u8], t: &FlowToken) -> [u8; TOKEN_LEN] {
    let mut out = [0u8; TOKEN_LEN];
    out[0] = VERSION;
    out[1] = t.kind;
    out[2..6].copy_from_slice(&t.expires.to_be_bytes());
    out[6..14].copy_from_slice(&t.nonce);
    let tag = mac_for(secret, &out[..HEAD_LEN]).finalize().into_bytes();
    out[HEAD_LEN..].copy_from_slice(&tag[..16]);
    out
}

/// Length, version and MAC (compared in constant time). Kind, expiry and
/// reuse are the guard's business.
pub fn verify(secret: &[u8], token: &[u8]) -> Option<FlowToken> {
    if token.len() != TOKEN_LEN || token[0] != VERSION {
        return None;
    }
    let (head, tag) = token.split_at(HEAD_LEN);
    mac_for(secret, head).verify_truncated_left(tag).ok()?;
    let mut nonce = [0u8; 8];
    nonce.copy_from_slice(&head[6..14]);
    Some(FlowToken {
        kind: head[1],
        expires: u32::from_be_bytes([head[2], head[3], head[4], head[5]]),
        nonce,
    })
}

/// Why a token was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reject {
    /// Wrong length, version or MAC.
    BadMac,
    /// A valid token for another kind of flow (a TCP token).
    WrongKind,
    Expired,
    Replayed,
    /// Too many live nonces to remember one more.
    Full,
    /// The state file could not be appended to: refuse rather than forget.
    StateWrite,
}

impl Reject {
    pub fn as_str(self) -> &'static str {
        match self {
            Reject::BadMac => "bad_mac",
            Reject::WrongKind => "wrong_kind",
            Reject::Expired => "expired",
            Reject::Replayed => "replayed",
            Reject::Full => "full",
            Reject::StateWrite => "state_write",
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Accepts each valid, unexpired Kick-Ass token once.
pub struct ReplayGuard {
    secret: Vec<u8>,
    seen: HashMap<[u8; 8], u32>,
    max_live: usize,
    state: Option<(PathBuf, File)>,
    /// Refusals by reason, for the exit counters.
    pub rejects: HashMap<Reject, u64>,
    pub accepted: u64,
    pub last_reject: Option<Reject>,
    clock: fn() -> u64,
}

impl fmt::Debug for ReplayGuard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplayGuard")
            .field("live_nonces", &self.seen.len())
            .field("accepted", &self.accepted)
            .finish_non_exhaustive()
    }
}

impl ReplayGuard {
    /// `clock` gives unix seconds (the expiry is wall-clock time).
    pub fn new(secret: Vec<u8>, clock: fn() -> u64) -> Self {
        ReplayGuard {
            secret,
            seen: HashMap::new(),
            max_live: 100_000,
            state: None,
            rejects: HashMap::new(),
            accepted: 0,
            last_reject: None,
            clock,
        }
    }

    /// Load the unexpired nonces of `path` (missing = empty) and append
    /// every newly used one there. Unparsable lines are skipped. The file
    /// is not rewritten: the Python agent appends to the same file and
    /// compacts it at its own start.
    pub fn with_state_file(mut self, path: &Path) -> io::Result<Self> {
        let now = (self.clock)();
        match std::fs::read_to_string(path) {
            Ok(text) => {
                for line in text.split_whitespace() {
                    let Some((n, e)) = line.split_once(':') else {
                        continue;
                    };
                    let (Some(nonce), Ok(exp)) = (parse_nonce(n), e.parse::<u64>()) else {
                        continue;
                    };
                    if exp >= now {
                        self.seen.insert(nonce, exp.min(u32::MAX as u64) as u32);
                    }
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let f = OpenOptions::new().create(true).append(true).open(path)?;
        self.state = Some((path.to_path_buf(), f));
        Ok(self)
    }

    pub fn live_nonces(&self) -> usize {
        self.seen.len()
    }

    /// The policy, at unix time `now`.
    pub fn check(&mut self, token: &[u8], now: u64) -> Result<FlowToken, Reject> {
        let r = self.check_inner(token, now);
        match r {
            Ok(_) => self.accepted += 1,
            Err(e) => {
                *self.rejects.entry(e).or_default() += 1;
                self.last_reject = Some(e);
            }
        }
        r
    }

    fn check_inner(&mut self, token: &[u8], now: u64) -> Result<FlowToken, Reject> {
        let t = verify(&self.secret, token).ok_or(Reject::BadMac)?;
        if t.kind != KIND_KICKASS {
            return Err(Reject::WrongKind);
        }
        if (t.expires as u64) < now {
            return Err(Reject::Expired);
        }
        if self.seen.contains_key(&t.nonce) {
            return Err(Reject::Replayed);
        }
        if self.seen.len() >= self.max_live {
            self.seen.retain(|_, &mut e| e as u64 >= now);
            if self.seen.len() >= self.max_live {
                return Err(Reject::Full);
            }
        }
        if let Some((_, f)) = &mut self.state {
            let line = format!("{}:{}\n", hex(&t.nonce), t.expires);
            // Written (and synced) before the flow is accepted.
            if f.write_all(line.as_bytes())
                .and_then(|_| f.sync_data())
                .is_err()
            {
                return Err(Reject::StateWrite);
            }
        }
        self.seen.insert(t.nonce, t.expires);
        Ok(t)
    }

    pub fn state_file(&self) -> Option<&Path> {
        self.state.as_ref().map(|(p, _)| p.as_path())
    }
}

impl TokenValidator for ReplayGuard {
    fn validate(&mut self, request: &TokenRequest<'_>) -> bool {
        let now = (self.clock)();
        self.check(request.token, now).is_ok()
    }
}

pub fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Hex to bytes; None on odd length or a non-hex digit.
pub fn unhex(s: &str) -> Option<Vec<u8>> {
    let s = s.trim();
    if s.len() % 2 != 0 || !s.is_ascii() {
        return None;
    }
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).ok())
        .collect()
}

fn parse_nonce(s: &str) -> Option<[u8; 8]> {
    let v = unhex(s)?;
    v.try_into().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t0() -> u64 {
        1_700_000_000
    }

    fn token(secret: &[u8], kind: u8, expires: u32, nonce: u8) -> [u8; TOKEN_LEN] {
        encode(
            secret,
            &FlowToken {
                kind,
                expires,
                nonce: [nonce; 8],
            },
        )
    }

    #[test]
    fn accepts_once_and_refuses_tampering() {
        let secret = b"0123456789abcdef".to_vec();
        let tok = token(&secret, KIND_KICKASS, 1_700_000_600, 7);
        let mut g = ReplayGuard::new(secret.clone(), t0);
        assert!(g.check(&tok, t0()).is_ok());
        assert_eq!(g.check(&tok, t0()), Err(Reject::Replayed));
        for i in 0..TOKEN_LEN {
            let mut bad = tok;
            bad[i] ^= 0x01;
            assert_eq!(g.check(&bad, t0()), Err(Reject::BadMac), "byte {i}");
        }
        assert_eq!(g.check(&tok[..29], t0()), Err(Reject::BadMac));
        let tcp = token(&secret, KIND_TCP, 1_700_000_600, 8);
        assert_eq!(g.check(&tcp, t0()), Err(Reject::WrongKind));
        let old = token(&secret, KIND_KICKASS, 1_699_999_999, 9);
        assert_eq!(g.check(&old, t0()), Err(Reject::Expired));
        assert_eq!(g.accepted, 1);
    }

    #[test]
    fn state_file_survives_a_restart() {
        let dir = std::env::temp_dir().join(format!("ka-agent-token-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("used-tokens");
        let _ = std::fs::remove_file(&path);
        // A line the Python guard wrote, an expired one and garbage.
        std::fs::write(
            &path,
            "0101010101010101:1800000000\n0202020202020202:5\nnonsense\n",
        )
        .unwrap();
        let secret = b"0123456789abcdef".to_vec();
        let mk = |n: u8| token(&secret, KIND_KICKASS, 1_800_000_000, n);
        let mut g = ReplayGuard::new(secret.clone(), t0)
            .with_state_file(&path)
            .unwrap();
        assert_eq!(g.live_nonces(), 1);
        assert_eq!(g.check(&mk(1), t0()), Err(Reject::Replayed));
        assert!(g.check(&mk(2), t0()).is_ok(), "its line had expired");
        assert!(g.check(&mk(3), t0()).is_ok());
        drop(g);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.ends_with("0202020202020202:1800000000\n0303030303030303:1800000000\n"));
        let mut g = ReplayGuard::new(secret.clone(), t0)
            .with_state_file(&path)
            .unwrap();
        assert_eq!(g.check(&mk(3), t0()), Err(Reject::Replayed));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn unhex_rejects_garbage() {
        assert_eq!(unhex("00ff"), Some(vec![0, 255]));
        assert_eq!(unhex("0"), None);
        assert_eq!(unhex("zz"), None);
        assert_eq!(unhex("é1"), None);
    }
}
