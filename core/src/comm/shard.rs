//! ZeRO-1: how a sharding [`Reducer`](super::Reducer) splits its buckets over
//! the ranks, and the all-gathers that put the updated parameters back.
//!
//! With [`BucketConfig::shard`](super::BucketConfig::shard) on, a bucket of
//! `len` gradients is cut in two:
//!
//! ```text
//! bucket  [ head: chunk × world elements                 | tail: len mod world ]
//!           rank 0's slice | rank 1's slice | …            all-reduced, on every rank
//! ```
//!
//! The head is reduce-scattered (average) in place: rank `r` ends with the
//! averaged gradients of its slice `head.start + r·chunk .. + chunk`, and
//! the rest of its head holds nothing useful. The tail (fewer than `world`
//! elements) is all-reduced, so every rank holds it averaged; every rank
//! updates it identically, which is why it never needs gathering. Slices and
//! tails lie inside the bucket, in place in the gradient buffer: no padding,
//! no side buffer, no copy. A rank's *owned* ranges — its slice of every
//! head and every tail — are what it updates and keeps optimizer state for:
//! `1/world` of the parameters, plus fewer than `world` elements per bucket.
//!
//! After the update, [`Reducer::all_gather_params`](super::Reducer::all_gather_params)
//! submits one in-place all-gather per bucket head on the *parameter* buffer
//! (the same element ranges), in layout order: the first layer's parameters
//! first, since the next forward pass reads them first. Each all-gather
//! writes its parameter range, so a forward task reading a parameter starts
//! once that range has arrived, by dependency inference, with no host wait.
//!
//! The layout follows the buckets, and the buckets are rebuilt after the
//! first step: until the reducer's layout is final
//! ([`Reducer::shards`](super::Reducer::shards) returns `Some`), its buckets
//! are all-reduced as without sharding, so every rank holds every averaged
//! gradient and can update any shard.

use std::ops::Range;

use super::BucketInfo;

/// One bucket as ZeRO-1 splits it over the ranks (see the module docs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketShard {
    /// The bucket's position in the bucket order.
    pub bucket: usize,
    /// The reduce-scattered elements: the bucket's first `chunk × world`.
    pub head: Range<usize>,
    /// Elements per rank in the head.
    pub chunk: usize,
    /// This rank's slice of the head (its reduce-scatter output).
    pub owned: Range<usize>,
    /// The last `len mod world` elements: all-reduced, held by every rank.
    pub tail: Range<usize>,
}

impl BucketShard {
    /// Splits `bucket` for rank `rank` of `world`.
    pub(super) fn new(bucket: &BucketInfo, rank: usize, world: usize) -> BucketShard {
        let e = &bucket.elems;
        let chunk = e.len() / world;
        let head_end = e.start + chunk * world;
        let at = e.start + rank * chunk;
        BucketShard {
            bucket: bucket.index,
            head: e.start..head_end,
            chunk,
            owned: at..at + chunk,
            tail: head_end..e.end,
        }
    }
}

/// This rank's ranges in layout order: its slice of every head and every
/// tail (empty ranges left out). What it updates and keeps state for.
pub fn owned_ranges(shards: &[BucketShard]) -> Vec<Range<usize>> {
    let mut out: Vec<Range<usize>> = shards
        .iter()
        .flat_map(|s| [s.owned.clone(), s.tail.clone()])
        .filter(|r| !r.is_empty())
        .collect();
    out.sort_by_key(|r| r.start);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heads_split_evenly_and_tails_stay_whole() {
        let b = BucketInfo {
            index: 3,
            elems: 100..111,
            params: vec![0],
        };
        let s: Vec<BucketShard> = (0..4).map(|r| BucketShard::new(&b, r, 4)).collect();
        assert_eq!(s[0].head, 100..108);
        assert_eq!(s[0].tail, 108..111);
        let owned: Vec<_> = s.iter().map(|s| s.owned.clone()).collect();
        assert_eq!(owned, vec![100..102, 102..104, 104..106, 106..108]);
        // A bucket smaller than the world: everything is tail.
        let small = BucketInfo {
            index: 0,
            elems: 0..3,
            params: vec![1],
        };
        let t = BucketShard::new(&small, 2, 4);
        assert!(t.owned.is_empty() && t.head.is_empty());
        assert_eq!(t.tail, 0..3);
        assert_eq!(
            owned_ranges(&[s[1].clone(), t]),
            vec![0..3, 102..104, 108..111]
        );
    }
}
