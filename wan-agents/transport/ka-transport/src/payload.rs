//! What a flow carries. Trials only need flows of a given size, so besides
//! real bytes a flow can carry a deterministic pattern derived from its id
//! and the byte offset: nothing is stored, and a receiver (or a test) can
//! check every byte it got without a copy of the original.

/// The bytes of one flow.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Payload {
    Bytes(Vec<u8>),
    /// `len` bytes of [`pattern_fill`] for this flow's id.
    Pattern {
        len: u64,
    },
}

impl Payload {
    pub fn len(&self) -> u64 {
        match self {
            Payload::Bytes(b) => b.len() as u64,
            Payload::Pattern { len } => *len,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Copy bytes `offset..offset + buf.len()` into `buf`.
    pub fn fill(&self, flow_id: u64, offset: u64, buf: &mut [u8]) {
        match self {
            Payload::Bytes(b) => {
                let o = offset as usize;
                buf.copy_from_slice(&b[o..o + buf.len()]);
            }
            Payload::Pattern { .. } => pattern_fill(flow_id, offset, buf),
        }
    }
}

fn mix(mut z: u64) -> u64 {
    // SplitMix64's finaliser: every byte depends on flow id and position.
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The pattern byte at `offset` of flow `flow_id`.
pub fn pattern_byte(flow_id: u64, offset: u64) -> u8 {
    let word = mix(flow_id.rotate_left(17) ^ (offset / 8).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    word.to_le_bytes()[(offset % 8) as usize]
}

/// Fill `buf` with the pattern bytes starting at `offset`.
pub fn pattern_fill(flow_id: u64, offset: u64, buf: &mut [u8]) {
    for (i, b) in buf.iter_mut().enumerate() {
        *b = pattern_byte(flow_id, offset + i as u64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_is_positional_and_flow_specific() {
        let mut a = [0u8; 20];
        pattern_fill(7, 100, &mut a);
        let mut b = [0u8; 10];
        pattern_fill(7, 110, &mut b);
        assert_eq!(&a[10..], &b[..]);
        let mut c = [0u8; 20];
        pattern_fill(8, 100, &mut c);
        assert_ne!(a, c);
        let p = Payload::Bytes(vec![1, 2, 3, 4]);
        let mut d = [0u8; 2];
        p.fill(0, 1, &mut d);
        assert_eq!(d, [2, 3]);
    }
}
