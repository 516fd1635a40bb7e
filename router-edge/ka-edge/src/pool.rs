//! Packet buffers reused across packets: a shell's datapath allocates
//! nothing per packet once warm (the router's and the link emulator's).

/// Free buffers of one size, kept up to a bound.
pub struct Pool {
    free: Vec<Vec<u8>>,
    size: usize,
    keep: usize,
}

impl Pool {
    /// Buffers of `size` bytes; at most `keep` are held when given back.
    pub fn new(size: usize, keep: usize) -> Self {
        Pool {
            free: Vec::new(),
            size,
            keep,
        }
    }

    /// A buffer of the pool's size (zeroed when new, stale bytes when reused).
    pub fn get(&mut self) -> Vec<u8> {
        match self.free.pop() {
            Some(mut b) => {
                b.resize(self.size, 0);
                b
            }
            None => vec![0u8; self.size],
        }
    }

    /// A buffer back for reuse (dropped when the pool holds `keep`).
    pub fn put(&mut self, b: Vec<u8>) {
        if self.free.len() < self.keep {
            self.free.push(b);
        }
    }
}
