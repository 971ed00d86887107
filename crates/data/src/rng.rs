//! Defines the crate's own seeded random number generator ([`Rng`], xoshiro256** seeded via
//! splitmix64) and a Fisher–Yates [`shuffle`].
//!
//! Sample orders must never change with a dependency upgrade, so nothing here comes from an
//! external crate; the algorithms are the published reference ones and are pinned by tests.

/// One step of splitmix64: advances `state` and returns the next output.
pub fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Combines several 64-bit values into one well-mixed seed (order-sensitive).
pub fn mix_seed(parts: &[u64]) -> u64 {
    let mut state = 0x5EED0FDA7A_u64;
    let mut out = 0u64;
    for &p in parts {
        state ^= p;
        out = splitmix64(&mut state);
        state = out;
    }
    out
}

/// xoshiro256** generator: small, fast, and fully specified here.
#[derive(Debug, Clone)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    /// Seeds the generator by expanding `seed` with splitmix64 (never yields the all-zero state).
    pub fn new(seed: u64) -> Self {
        let mut sm = seed;
        let s = [
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ];
        Rng { s }
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform integer in `[0, n)` without modulo bias (Lemire's multiply-and-reject).
    /// Returns 0 when `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            return 0;
        }
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }
}

/// Shuffles `items` in place with the Fisher–Yates algorithm driven by `rng`.
pub fn shuffle<T>(items: &mut [T], rng: &mut Rng) {
    for i in (1..items.len()).rev() {
        let j = rng.below(i as u64 + 1) as usize;
        items.swap(i, j);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix_reference_values() {
        // Reference outputs of splitmix64 seeded with 0.
        let mut s = 0u64;
        assert_eq!(splitmix64(&mut s), 0xE220_A839_7B1D_CDAF);
        assert_eq!(splitmix64(&mut s), 0x6E78_9E6A_A1B9_65F4);
    }

    #[test]
    fn stream_is_pinned() {
        // xoshiro256** seeded through splitmix64(42), cross-checked against an independent
        // transcription of the reference algorithm; sample orders depend on these values.
        let mut r = Rng::new(42);
        assert_eq!(r.next_u64(), 0x1578_0B2E_0C2E_C716);
        assert_eq!(r.next_u64(), 0x6104_D986_6D11_3A7E);
        assert_eq!(r.next_u64(), 0xAE17_5332_39E4_99A1);
        assert_ne!(Rng::new(43).next_u64(), 0x1578_0B2E_0C2E_C716);
    }

    #[test]
    fn below_is_in_range_and_roughly_uniform() {
        let mut r = Rng::new(7);
        let mut counts = [0u32; 5];
        for _ in 0..50_000 {
            counts[r.below(5) as usize] += 1;
        }
        for c in counts {
            assert!((9_000..11_000).contains(&c), "{counts:?}");
        }
        assert_eq!(r.below(0), 0);
        assert_eq!(r.below(1), 0);
    }

    #[test]
    fn shuffle_is_a_permutation_and_seeded() {
        let mut a: Vec<u32> = (0..100).collect();
        let mut b = a.clone();
        shuffle(&mut a, &mut Rng::new(1));
        shuffle(&mut b, &mut Rng::new(1));
        assert_eq!(a, b);
        let mut sorted = a.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
        let mut c: Vec<u32> = (0..100).collect();
        shuffle(&mut c, &mut Rng::new(2));
        assert_ne!(a, c);
    }

    #[test]
    fn mix_seed_is_order_sensitive() {
        assert_ne!(mix_seed(&[1, 2]), mix_seed(&[2, 1]));
        assert_eq!(mix_seed(&[1, 2]), mix_seed(&[1, 2]));
    }
}
