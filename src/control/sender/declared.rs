//! A request's declared first batch: the keys, lengths and last-chunk
//! tokens of its first batch, given at begin
//! ([`Sender::begin_declared`](super::Sender::begin_declared)) so that the
//! admission AllocRequest carries them and the receiver allocates that
//! batch's slots as it admits the request: one control round trip per
//! request fewer. Its bytes follow later
//! ([`StagedBatch::submit_declared`](super::StagedBatch::submit_declared)),
//! once staging was handed to the admitted request (DESIGN.md invariant 2
//! holds: nothing is staged before admission).

use std::num::NonZeroU64;

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
    /// Checks `d` against the request `spec` of geometry `g` as a staged
    /// batch is checked at submit (key count, size, every length, the last
    /// chunk's tokens) and against its total. Returns its chunk count and
    /// its last chunk's token count as the AllocRequest carries it (the
    /// caller's, or the tokens the last chunk's length holds).
    pub(super) fn check_declared(
        &self,
        spec: &RequestSpec,
        g: request::Geometry,
        d: &Declared,
    ) -> Result<(usize, i64), StoreError> {
        let n = d.lens.len();
        if d.keys.len() != n {
            return Err(StoreError::KeyCountMismatch {
                keys: d.keys.len(),
                chunks: n,
            });
        }
        if n == 0 {
            return Err(StoreError::EmptyDeclaredBatch);
        }
        if n > self.cfg.staging_slots {
            return Err(StoreError::BatchTooLarge {
                chunks: n,
                slots: self.cfg.staging_slots,
            });
        }
        if n > spec.total_chunks {
            return Err(StoreError::TooManyChunks {
                req_id: spec.req_id.clone(),
                chunks: n,
                total: spec.total_chunks,
            });
        }
        Self::check_lens(g, d.lens.iter().map(|&l| u64::from(l)), d.toks)?;
        // The default, as a submitted batch's (`Shared::publish`).
        let unit = g.token_bytes.map_or(1, NonZeroU64::get);
        let toks = d
            .toks
            .unwrap_or_else(|| d.lens.last().map_or(0, |&l| (u64::from(l) / unit) as i64));
        Ok((n, toks))
    }
}
