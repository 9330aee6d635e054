//! Random damage to a safetensors file, for the tests that loading one
//! never panics: bytes of its header (the JSON of names, dtypes, shapes,
//! offsets and metadata) replaced, inserted or removed, and the file cut
//! short. Seeded, so a failure repeats.

/// Bytes a header edit writes: what JSON and the names are made of.
pub const JSON_BYTES: &[u8] = b"{}[]\":,.0123456789-eE_abfhlnrstuwF ";

/// A seeded source of damage (xorshift64*).
pub struct Damage {
    state: u64,
}

impl Damage {
    pub fn new(seed: u64) -> Self {
        Damage { state: seed | 1 }
    }

    /// A number below `n` (0 for `n` = 0).
    fn below(&mut self, n: usize) -> usize {
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        (self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % n.max(1)
    }

    /// `file` (a safetensors file) with one to three header bytes replaced,
    /// inserted or removed, then, with `cut`, truncated at a random length.
    pub fn apply(&mut self, file: &[u8], cut: bool) -> Vec<u8> {
        let mut b = file.to_vec();
        let mut end = 8 + u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
        for _ in 0..1 + self.below(3) {
            let at = 8 + self.below(end - 8);
            let byte = JSON_BYTES[self.below(JSON_BYTES.len())];
            match self.below(3) {
                0 => b[at] = byte,
                1 => {
                    b.insert(at, byte);
                    end += 1;
                }
                _ => {
                    b.remove(at);
                    end -= 1;
                }
            }
        }
        if cut {
            let len = self.below(b.len());
            b.truncate(len);
        }
        b
    }
}
