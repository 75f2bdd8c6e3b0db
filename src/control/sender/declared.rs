//! A request's declared first batch: the keys, lengths and last-chunk
//! tokens of its first batch, given at begin
//! ([`Sender::begin_declared`](super::Sender::begin_declared)) so that the
//! admission AllocRequest carries them and the receiver allocates that
//! batch's slots as it admits the request: one control round trip per
//! request fewer. Its bytes follow later
//! ([`StagedBatch::submit_declared`](super::StagedBatch::submit_declared)),
//! once staging was handed to the admitted request (DESIGN.md invariant 2
//! holds: nothing is staged before admission).

use smallvec::SmallVec;

use super::keys::KeyList;
use super::{request, RequestSpec, Shared, StoreError};

/// A declared first batch, as the caller gave it.
#[derive(Debug)]
pub(super) struct Declared {
    pub keys: KeyList,
    pub lens: SmallVec<[u32; 16]>,
    /// The last chunk's token count, if the caller gave it.
    pub toks: Option<i64>,
}

impl Shared {
    /// Checks `d` against the request `spec` of geometry `g` as a batch is
    /// checked ([`validate_lens`](Self::validate_lens)), and that it has a
    /// chunk and no more than the request's total. Returns its chunk count
    /// and its last chunk's token count as the AllocRequest carries it.
    pub(super) fn check_declared(
        &self,
        spec: &RequestSpec,
        g: request::Geometry,
        d: &Declared,
    ) -> Result<(usize, i64), StoreError> {
        let n = d.lens.len();
        self.validate_lens(
            g,
            d.keys.len(),
            d.lens.iter().map(|&l| u64::from(l)),
            d.toks,
        )?;
        if n == 0 {
            return Err(StoreError::EmptyDeclaredBatch);
        }
        if n > spec.total_chunks {
            return Err(StoreError::TooManyChunks {
                req_id: spec.req_id.clone(),
                chunks: n,
                total: spec.total_chunks,
            });
        }
        Ok((n, Self::last_chunk_toks(g, d.lens.last().copied(), d.toks)))
    }
}
