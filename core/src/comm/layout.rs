//! How a flat gradient buffer is cut into buckets: the parameters' ranges
//! ([`ParamSpec`]), the buckets ([`BucketInfo`]) and the rule that forms
//! them from a ready order. A leaf shared by the reducer (`bucket.rs`) and
//! its cost model (`cap.rs`), so the model prices exactly the buckets the
//! reducer would build.

use std::ops::Range;

/// A parameter: its name and its element range in the flat buffers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ParamSpec {
    /// Name (for errors).
    pub name: String,
    /// Element range in the flat parameter and gradient buffers.
    pub range: Range<usize>,
}

impl ParamSpec {
    /// A parameter named `name` at element range `range`.
    pub fn new(name: impl Into<String>, range: Range<usize>) -> Self {
        ParamSpec {
            name: name.into(),
            range,
        }
    }
}

/// One bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BucketInfo {
    /// Position in the bucket order.
    pub index: usize,
    /// Element range in the gradient buffer.
    pub elems: Range<usize>,
    /// Its parameters, in the order they joined.
    pub params: Vec<usize>,
}

/// Forms contiguous buckets from `order` (see `bucket.rs`'s module docs); elements
/// are `elem_bytes` long.
pub(crate) fn form_buckets(
    params: &[ParamSpec],
    order: &[usize],
    first_cap: usize,
    cap: usize,
    elem_bytes: usize,
) -> Vec<BucketInfo> {
    let mut out: Vec<BucketInfo> = Vec::new();
    let mut open: Option<(Range<usize>, Vec<usize>)> = None;
    for &p in order {
        let r = params[p].range.clone();
        let limit = if out.is_empty() { first_cap } else { cap };
        if let Some((range, ps)) = &mut open {
            let adjacent = r.end == range.start || r.start == range.end;
            if adjacent && (range.len() + r.len()) * elem_bytes <= limit {
                *range = range.start.min(r.start)..range.end.max(r.end);
                ps.push(p);
                continue;
            }
        }
        if let Some((elems, params)) = open.take() {
            out.push(BucketInfo {
                index: out.len(),
                elems,
                params,
            });
        }
        open = Some((r, vec![p]));
    }
    if let Some((elems, params)) = open {
        out.push(BucketInfo {
            index: out.len(),
            elems,
            params,
        });
    }
    out
}
