//! The bucket cap, chosen from a model of the reducer's pipeline.
//!
//! The model is pure: given what one step measured — each parameter's
//! gradient-ready time, in the order the gradients became ready, and the end
//! of the backward pass — and a link cost (α ns per collective, β ns per
//! byte), it replays the reducer under a candidate cap:
//!
//! * the buckets are the reducer's own (`form_buckets` in `layout.rs`: runs of
//!   memory-adjacent parameters in ready order, the first bucket under the
//!   first cap, a parameter larger than the cap a bucket of its own);
//! * a bucket is complete when its last parameter is ready;
//! * one collective at a time on the comm stream, in bucket order: bucket `i`
//!   starts at the later of its completion and the end of bucket `i − 1`, and
//!   takes `α + β·bytes`;
//! * ZeRO-1 ([`CapInput::shard_world`]): a bucket is a reduce-scatter of its
//!   head, priced as half an all-reduce of the head's bytes (a ring moves
//!   `(n−1)/n` of the bytes instead of `2(n−1)/n`), plus an all-reduce of its
//!   tail when there is one. The parameters' all-gathers at the start of the
//!   next step are not modelled (they overlap the forward pass, whatever the
//!   cap, and cost one collective per bucket head).
//!
//! It predicts, per cap, the end of communication, the communication exposed
//! after the backward pass (`max(0, end − backward end)`) and the number of
//! collectives; [`choose_cap`] picks the cap with the least exposed time, the
//! larger cap on a tie (fewer collectives for the same exposure).
//!
//! [`Link::fit`] fits α and β by least squares to measured collectives
//! (bytes, duration), clamped to [`Link::MIN_BETA`]..[`Link::MAX_BETA`] and
//! `0..=`[`Link::MAX_ALPHA`]. The reducer calibrates both from its own first
//! step ([`BucketConfig::auto_cap`](super::BucketConfig::auto_cap)).

use super::layout::{form_buckets, ParamSpec};
use super::shard::BucketShard;
use crate::error::{Error, Result};

/// The caps [`choose_cap`] tries by default: ¼ MiB to 64 MiB.
pub const CAP_CANDIDATES: [usize; 10] = [
    1 << 18,
    1 << 19,
    1 << 20,
    2 << 20,
    4 << 20,
    8 << 20,
    16 << 20,
    25 << 20,
    32 << 20,
    64 << 20,
];

/// The cost of one collective: `alpha_ns + beta_ns_per_byte · bytes`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// Fixed cost per collective (latency, launch, rendezvous), ns.
    pub alpha_ns: f64,
    /// Cost per byte of the bucket, ns (an all-reduce's whole buffer).
    pub beta_ns_per_byte: f64,
}

impl Link {
    /// The largest α a fit gives: 10 ms.
    pub const MAX_ALPHA: f64 = 1e7;
    /// The smallest β a fit gives: 10⁻⁴ ns per byte (10 TB/s).
    pub const MIN_BETA: f64 = 1e-4;
    /// The largest β a fit gives: 100 ns per byte (10 MB/s).
    pub const MAX_BETA: f64 = 100.0;

    /// The predicted duration of an all-reduce of `bytes`, ns.
    pub fn cost_ns(&self, bytes: usize) -> f64 {
        self.alpha_ns + self.beta_ns_per_byte * bytes as f64
    }

    /// Least-squares fit of `duration = α + β·bytes` to `samples` of
    /// (bytes, duration in ns). With one distinct size, or a fit whose
    /// intercept is negative, the line through the origin (α = 0); a
    /// non-positive slope gives β = [`MIN_BETA`](Self::MIN_BETA) and α the
    /// mean duration. The result is clamped to the bounds above. Fails on no
    /// sample or a non-finite one.
    pub fn fit(samples: &[(usize, f64)]) -> Result<Link> {
        if samples.is_empty() {
            return Err(Error::Config("link fit: no collective was measured".into()));
        }
        if let Some((b, d)) = samples.iter().find(|(_, d)| !d.is_finite() || *d < 0.0) {
            return Err(Error::Config(format!(
                "link fit: the collective of {b} bytes has no valid duration ({d} ns)"
            )));
        }
        let n = samples.len() as f64;
        let mb = samples.iter().map(|s| s.0 as f64).sum::<f64>() / n;
        let md = samples.iter().map(|s| s.1).sum::<f64>() / n;
        let sxx: f64 = samples.iter().map(|s| (s.0 as f64 - mb).powi(2)).sum();
        let sxy: f64 = samples.iter().map(|s| (s.0 as f64 - mb) * (s.1 - md)).sum();
        let through_origin = || {
            let bb: f64 = samples.iter().map(|s| (s.0 as f64).powi(2)).sum();
            let bd: f64 = samples.iter().map(|s| s.0 as f64 * s.1).sum();
            (0.0, if bb > 0.0 { bd / bb } else { 0.0 })
        };
        let (alpha, beta) = if sxx <= 0.0 {
            through_origin()
        } else {
            let beta = sxy / sxx;
            let alpha = md - beta * mb;
            if beta <= 0.0 {
                (md, 0.0)
            } else if alpha < 0.0 {
                through_origin()
            } else {
                (alpha, beta)
            }
        };
        Ok(Link {
            alpha_ns: alpha.clamp(0.0, Self::MAX_ALPHA),
            beta_ns_per_byte: beta.clamp(Self::MIN_BETA, Self::MAX_BETA),
        })
    }
}

/// What one step measured, for [`predict`].
///
/// Invariants (checked by [`predict`]): `params` in layout order, as the
/// reducer holds them; `order` a permutation of their indices (the order the
/// gradients became ready); `ready_ns[p]` the time parameter `p`'s gradient
/// was complete. Times are ns from any one origin, the same for
/// `backward_end_ns`.
#[derive(Debug, Clone)]
pub struct CapInput<'a> {
    /// The parameters, in layout order.
    pub params: &'a [ParamSpec],
    /// Parameter indices in ready order.
    pub order: &'a [usize],
    /// Ready time of each parameter's gradient (indexed by parameter), ns.
    pub ready_ns: &'a [u64],
    /// End of the backward pass, ns.
    pub backward_end_ns: u64,
    /// Bytes per gradient element (4 for f32, 2 for bf16).
    pub elem_bytes: usize,
    /// The first bucket's cap, bytes.
    pub first_cap_bytes: usize,
    /// ZeRO-1 over this many ranks: buckets are reduce-scattered (see the
    /// module docs); `None`: all-reduced.
    pub shard_world: Option<usize>,
}

/// What [`predict`] says of one cap.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CapPrediction {
    /// The cap, bytes.
    pub cap_bytes: usize,
    /// End of the last collective, ns (same origin as the input).
    pub end_ns: f64,
    /// Communication after the backward pass: `max(0, end − backward end)`, ns.
    pub exposed_ns: f64,
    /// Collectives submitted.
    pub collectives: usize,
}

/// What the reducer chose ([`BucketConfig::auto_cap`](super::BucketConfig::auto_cap)),
/// on rank 0, which decides for every rank
/// ([`Reducer::cap_choice`](super::Reducer::cap_choice)).
#[derive(Debug, Clone, PartialEq)]
pub struct CapChoice {
    /// The chosen prediction (its cap is the buckets' cap from the rebuild on).
    pub chosen: CapPrediction,
    /// The prediction for the configured cap
    /// ([`BucketConfig::cap_bytes`](super::BucketConfig::cap_bytes)), the
    /// first step's.
    pub configured: CapPrediction,
    /// Every candidate's prediction.
    pub all: Vec<CapPrediction>,
    /// The fitted link.
    pub link: Link,
    /// Collectives the link was fitted to (the first step's buckets).
    pub samples: usize,
    /// What the first step measured: its buckets' communication after its
    /// backward pass, ns (what `configured` predicts).
    pub measured_exposed_ns: f64,
}

/// Predicts the reducer's pipeline under `cap_bytes` (see the module docs).
/// Fails if the input breaks its invariants.
pub fn predict(input: &CapInput<'_>, link: Link, cap_bytes: usize) -> Result<CapPrediction> {
    let n = input.params.len();
    let bad = |m: String| Err(Error::Config(format!("bucket cap model: {m}")));
    if input.ready_ns.len() != n {
        return bad(format!(
            "{} ready times for {n} parameters",
            input.ready_ns.len()
        ));
    }
    let mut seen = vec![false; n];
    for &p in input.order {
        if p >= n || std::mem::replace(&mut seen[p], true) {
            return bad(format!(
                "the ready order is not a permutation of the {n} parameters (#{p})"
            ));
        }
    }
    if input.order.len() != n {
        return bad(format!(
            "the ready order lists {} of the {n} parameters",
            input.order.len()
        ));
    }
    if input.elem_bytes == 0 || cap_bytes == 0 || input.first_cap_bytes == 0 {
        return bad("element size and caps must be positive".into());
    }
    let buckets = form_buckets(
        input.params,
        input.order,
        input.first_cap_bytes,
        cap_bytes,
        input.elem_bytes,
    );
    let mut end = f64::NEG_INFINITY;
    let mut collectives = 0;
    for b in &buckets {
        let ready = b
            .params
            .iter()
            .map(|&p| input.ready_ns[p])
            .max()
            .unwrap_or(0) as f64;
        let cost = match input.shard_world {
            Some(world) if world > 1 => {
                let s = BucketShard::new(b, 0, world);
                let mut c = 0.0;
                if s.chunk > 0 {
                    c += link.alpha_ns
                        + 0.5 * link.beta_ns_per_byte * (s.head.len() * input.elem_bytes) as f64;
                    collectives += 1;
                }
                if !s.tail.is_empty() {
                    c += link.cost_ns(s.tail.len() * input.elem_bytes);
                    collectives += 1;
                }
                c
            }
            _ => {
                collectives += 1;
                link.cost_ns(b.elems.len() * input.elem_bytes)
            }
        };
        end = end.max(ready) + cost;
    }
    if buckets.is_empty() {
        end = input.backward_end_ns as f64;
    }
    Ok(CapPrediction {
        cap_bytes,
        end_ns: end,
        exposed_ns: (end - input.backward_end_ns as f64).max(0.0),
        collectives,
    })
}

/// Predicts every cap of `candidates` and picks the one with the least
/// exposed time, the larger cap on a tie (within 1 ns). Returns the chosen
/// prediction and all of them, in the order of `candidates`. Fails on no
/// candidate or a bad input.
pub fn choose_cap(
    input: &CapInput<'_>,
    link: Link,
    candidates: &[usize],
) -> Result<(CapPrediction, Vec<CapPrediction>)> {
    let all = candidates
        .iter()
        .map(|&c| predict(input, link, c))
        .collect::<Result<Vec<_>>>()?;
    let best = all
        .iter()
        .copied()
        .reduce(|a, b| {
            let d = b.exposed_ns - a.exposed_ns;
            if d < -1.0 || (d.abs() <= 1.0 && b.cap_bytes > a.cap_bytes) {
                b
            } else {
                a
            }
        })
        .ok_or_else(|| Error::Config("bucket cap model: no candidate cap".into()))?;
    Ok((best, all))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: usize = 1 << 20;

    /// `n` f32 parameters of `mib` MiB each, in layout order; backward makes
    /// them ready last first, one every `gap` ns from `gap`; it ends at the
    /// last one.
    fn chain(n: usize, mib: usize, gap: u64) -> (Vec<ParamSpec>, Vec<usize>, Vec<u64>, u64) {
        let per = mib * MIB / 4;
        let params: Vec<ParamSpec> = (0..n)
            .map(|i| ParamSpec::new(format!("p{i}"), i * per..(i + 1) * per))
            .collect();
        let order: Vec<usize> = (0..n).rev().collect();
        let mut ready = vec![0; n];
        for (k, &p) in order.iter().enumerate() {
            ready[p] = gap * (k as u64 + 1);
        }
        (params, order, ready, gap * n as u64)
    }

    fn input<'a>(p: &'a [ParamSpec], o: &'a [usize], r: &'a [u64], end: u64) -> CapInput<'a> {
        CapInput {
            params: p,
            order: o,
            ready_ns: r,
            backward_end_ns: end,
            elem_bytes: 4,
            first_cap_bytes: MIB,
            shard_world: None,
        }
    }

    #[test]
    fn pipeline_is_one_collective_at_a_time() {
        // 4 params of 1 MiB ready at 10, 20, 30, 40 µs; cap 1 MiB: 4 buckets.
        let (p, o, r, end) = chain(4, 1, 10_000);
        let link = Link {
            alpha_ns: 1_000.0,
            beta_ns_per_byte: 0.01,
        };
        let one = link.cost_ns(MIB); // 11,485.76 ns
        let got = predict(&input(&p, &o, &r, end), link, MIB).unwrap();
        assert_eq!(got.collectives, 4);
        // Each starts at 10k·k, after the previous ended (10k + one > 20k).
        let mut t: f64 = 0.0;
        for k in 1..=4 {
            t = t.max(10_000.0 * k as f64) + one;
        }
        assert!((got.end_ns - t).abs() < 1e-6, "{} vs {t}", got.end_ns);
        assert!((got.exposed_ns - (t - 40_000.0)).abs() < 1e-6);
        // One bucket of everything (cap 64 MiB; the first cap still holds
        // only the first parameter): 2 collectives.
        let got = predict(&input(&p, &o, &r, end), link, 64 * MIB).unwrap();
        assert_eq!(got.collectives, 2);
        let t = (10_000.0 + one).max(40_000.0) + link.cost_ns(3 * MIB);
        assert!((got.end_ns - t).abs() < 1e-6);
    }

    #[test]
    fn no_latency_picks_the_smallest_cap_and_huge_latency_one_bucket() {
        // 32 parameters of 1 MiB, one every 100 µs.
        let (p, o, r, end) = chain(32, 1, 100_000);
        let i = input(&p, &o, &r, end);
        // β only, 1 MiB in 52 µs: each 1 MiB bucket is done before the
        // next parameter is ready, so only the last one (52 µs) is exposed;
        // a cap of k MiB leaves k MiB after the backward pass.
        let free = Link {
            alpha_ns: 0.0,
            beta_ns_per_byte: 0.05,
        };
        let (best, all) = choose_cap(&i, free, &CAP_CANDIDATES).unwrap();
        // Caps under 1 MiB give the same buckets as 1 MiB (a parameter over
        // the cap is alone): the tie goes to the larger, 1 MiB.
        assert_eq!(best.cap_bytes, MIB, "{all:?}");
        assert!((best.exposed_ns - free.cost_ns(MIB)).abs() < 1e-6);
        assert!(all[3].exposed_ns > best.exposed_ns + 1e3, "{all:?}");
        // α dominates: every collective costs 100 ms; fewest collectives win.
        let slow = Link {
            alpha_ns: 1e8,
            beta_ns_per_byte: 0.05,
        };
        let (best, all) = choose_cap(&i, slow, &CAP_CANDIDATES).unwrap();
        assert_eq!(best.cap_bytes, 64 * MIB, "{all:?}");
        assert_eq!(best.collectives, 2);
    }

    #[test]
    fn all_hidden_ties_go_to_the_larger_cap() {
        // A long stretch of compute after the last gradient (100 ms) hides
        // every cap's communication: the largest cap wins the tie.
        let (p, o, r, _) = chain(8, 1, 1_000_000);
        let link = Link {
            alpha_ns: 10.0,
            beta_ns_per_byte: 1e-3,
        };
        let i = input(&p, &o, &r, 100_000_000);
        let (best, all) = choose_cap(&i, link, &CAP_CANDIDATES).unwrap();
        assert!(all.iter().all(|a| a.exposed_ns == 0.0));
        assert_eq!(best.cap_bytes, 64 * MIB);
    }

    #[test]
    fn zero1_prices_reduce_scatter_as_half_plus_tail() {
        // One parameter of 10 f32s over 4 ranks: head 8, tail 2.
        let p = vec![ParamSpec::new("w", 0..10)];
        let (o, r) = (vec![0], vec![0]);
        let mut i = input(&p, &o, &r, 0);
        i.shard_world = Some(4);
        let link = Link {
            alpha_ns: 100.0,
            beta_ns_per_byte: 1.0,
        };
        let got = predict(&i, link, MIB).unwrap();
        assert_eq!(got.collectives, 2);
        assert_eq!(got.end_ns, 100.0 + 0.5 * 32.0 + 100.0 + 8.0);
    }

    #[test]
    fn fit_recovers_a_line_and_clamps() {
        let s: Vec<(usize, f64)> = [1usize << 10, 1 << 20, 4 << 20]
            .iter()
            .map(|&b| (b, 5_000.0 + 0.25 * b as f64))
            .collect();
        let l = Link::fit(&s).unwrap();
        assert!((l.alpha_ns - 5_000.0).abs() < 1e-3, "{l:?}");
        assert!((l.beta_ns_per_byte - 0.25).abs() < 1e-9, "{l:?}");
        // One size: through the origin.
        let l = Link::fit(&[(1000, 500.0), (1000, 700.0)]).unwrap();
        assert_eq!(l.alpha_ns, 0.0);
        assert!((l.beta_ns_per_byte - 0.6).abs() < 1e-12);
        // Larger buckets faster (noise): β at its floor, α the mean.
        let l = Link::fit(&[(1000, 900.0), (2000, 100.0)]).unwrap();
        assert_eq!(l.beta_ns_per_byte, Link::MIN_BETA);
        assert_eq!(l.alpha_ns, 500.0);
        assert!(Link::fit(&[])
            .unwrap_err()
            .to_string()
            .contains("no collective"));
        assert!(Link::fit(&[(8, f64::NAN)]).is_err());
    }

    #[test]
    fn bad_inputs_are_named() {
        let (p, _, r, end) = chain(3, 1, 10);
        let link = Link {
            alpha_ns: 1.0,
            beta_ns_per_byte: 1.0,
        };
        let o = [0, 0, 1];
        let e = predict(&input(&p, &o, &r, end), link, MIB).unwrap_err();
        assert!(e.to_string().contains("not a permutation"), "{e}");
        let o = [2, 1];
        let e = predict(&input(&p, &o, &r, end), link, MIB).unwrap_err();
        assert!(e.to_string().contains("lists 2 of the 3"), "{e}");
        let o = [2, 1, 0];
        let e = predict(&input(&p, &o, &r[..2], end), link, MIB).unwrap_err();
        assert!(e.to_string().contains("2 ready times"), "{e}");
        assert!(choose_cap(&input(&p, &o, &r, end), link, &[]).is_err());
    }
}
