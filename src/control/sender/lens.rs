//! The batch-length rules: the checks a batch passes before its chunks are
//! reserved (key count, batch size, each chunk's length and the last
//! chunk's tokens), the same for every path a batch takes (a method group
//! of `Shared`).

use std::num::NonZeroU64;

use super::{request, Shared, StoreError};

impl Shared {
    /// The checks of a copied batch of a request of geometry `g`, its last
    /// chunk `toks` tokens if given.
    pub(super) fn validate_batch(
        &self,
        g: request::Geometry,
        n_keys: usize,
        chunks: &[&[u8]],
        toks: Option<i64>,
    ) -> Result<(), StoreError> {
        self.validate_lens(g, n_keys, chunks.iter().map(|c| c.len() as u64), toks)
    }

    /// The checks of a batch of `n_keys` keys whose chunks are `lens`
    /// bytes long, of a request of geometry `g`, its last chunk `toks`
    /// tokens if given: one key per chunk, no more chunks than staging
    /// slots, and [`check_lens`](Self::check_lens). A copied batch's
    /// ([`validate_batch`](Self::validate_batch)) and a declared one's.
    pub(super) fn validate_lens(
        &self,
        g: request::Geometry,
        n_keys: usize,
        lens: impl ExactSizeIterator<Item = u64>,
        toks: Option<i64>,
    ) -> Result<(), StoreError> {
        let n = lens.len();
        if n_keys != n {
            return Err(StoreError::KeyCountMismatch {
                keys: n_keys,
                chunks: n,
            });
        }
        if n > self.cfg.staging_slots {
            return Err(StoreError::BatchTooLarge {
                chunks: n,
                slots: self.cfg.staging_slots,
            });
        }
        Self::check_lens(g, lens, toks)
    }

    /// The token count of a batch's last chunk as its AllocRequest
    /// carries it: `toks` if given, else the whole tokens the last chunk
    /// (`last` bytes) holds (its bytes for the byte shape; `check_lens`
    /// refused a partial token); 0 for an empty batch.
    pub(super) fn last_chunk_toks(
        g: request::Geometry,
        last: Option<u32>,
        toks: Option<i64>,
    ) -> i64 {
        let unit = g.token_bytes.map_or(1, NonZeroU64::get);
        toks.unwrap_or_else(|| last.map_or(0, |l| (u64::from(l) / unit) as i64))
    }

    /// The lengths of a batch's chunks, in order, for a request of geometry
    /// `g`, its last chunk `toks` tokens if given: none longer than a whole
    /// chunk (which a staging slot holds), every one but the last whole
    /// (the receiver takes those as whole), and for a one-dimensional shape
    /// the last exactly `toks` tokens, or a whole number of them (the
    /// receiver sizes it so); `toks` in `0..=u32::MAX` whatever the shape.
    /// The one check of every path a batch takes (staged, copied,
    /// registered).
    pub(super) fn check_lens(
        g: request::Geometry,
        lens: impl ExactSizeIterator<Item = u64>,
        toks: Option<i64>,
    ) -> Result<(), StoreError> {
        // A count the wire and the decoder's 32-bit token field carry, for
        // every geometry (the receiver refuses a negative one as a bad
        // message, and reads one past u32 as u32::MAX).
        if let Some(t) = toks.filter(|&t| u32::try_from(t).is_err()) {
            return Err(StoreError::TokensOutOfRange { tokens: t });
        }
        let full = g.full;
        let last = lens.len().saturating_sub(1);
        for (index, len) in lens.enumerate() {
            if len > full {
                return Err(StoreError::ChunkTooLarge {
                    index,
                    len: len as usize,
                    max: full,
                });
            }
            if index < last && len != full {
                return Err(StoreError::ShortChunk {
                    index,
                    len: len as usize,
                    full,
                });
            }
            if index == last {
                Self::check_tokens(g, len, toks)?;
            }
        }
        Ok(())
    }

    /// A batch's last chunk of `len` bytes and `toks` tokens (default: as
    /// many as `len` holds) against a one-dimensional geometry `g`.
    fn check_tokens(g: request::Geometry, len: u64, toks: Option<i64>) -> Result<(), StoreError> {
        let Some(unit) = g.token_bytes.map(NonZeroU64::get) else {
            return Ok(());
        };
        let fits = match toks {
            Some(t) => u64::try_from(t).is_ok_and(|t| t.checked_mul(unit) == Some(len)),
            None => len % unit == 0,
        };
        if fits {
            Ok(())
        } else {
            Err(StoreError::LastChunkTokens {
                len: len as usize,
                tokens: toks,
                token_bytes: unit,
            })
        }
    }
}
