//! Golden replies as LMCache's sender checks them, and as `placement`
//! reads them.

use super::*;

/// LMCache 0.5.6's sender checks on a reply to `n_keys` keys, written out
/// as its `_async_transfer_task` does (independent of `placement`).
fn lmcache_accepts(n_keys: usize, r: &AllocResponse) -> Result<(), String> {
    let already: std::collections::BTreeSet<i64> = r.already_sent_indexes.iter().copied().collect();
    if already.iter().any(|&i| i < 0 || i as usize >= n_keys) {
        return Err(format!(
            "Invalid already_sent_indexes from receiver: {already:?}"
        ));
    }
    let expected = n_keys - already.len();
    if r.remote_indexes.len() != expected {
        return Err(format!(
            "AllocResponse inconsistency: total_keys={n_keys}, already_sent={}, remote_indexes={}, expected={expected}",
            already.len(),
            r.remote_indexes.len()
        ));
    }
    Ok(())
}

/// Every golden reply passes LMCache's sender check for the batch it
/// answers, and `placement` reads it the same way.
#[test]
fn golden_replies_pass_lmcaches_consistency_check() {
    type Case = (&'static [u8], usize, &'static [(usize, i64)]);
    let cases: [Case; 3] = [
        (&ALLOC_RESPONSE_OK[..], 3, &[(0, 0), (2, 5)]),
        (&ALLOC_RESPONSE_DEDUP[..], 2, &[(1, 2)]),
        (&ALLOC_RESPONSE_FAIL[..], 2, &[(0, -1), (1, -1)]),
    ];
    for (bytes, n_keys, writes) in cases {
        let Message::AllocResponse(r) = decode(bytes).unwrap() else {
            panic!("not an AllocResponse");
        };
        assert_eq!(lmcache_accepts(n_keys, &r), Ok(()), "{r:?}");
        let p = placement(n_keys, &r).unwrap();
        assert_eq!(p.writes.as_slice(), writes, "{r:?}");
    }
    // The reply kvferry's receiver used to send for issue 12's case.
    let old = AllocResponse::ok(vec![0, 2], vec![0], None);
    assert_eq!(
        lmcache_accepts(2, &old),
        Err("AllocResponse inconsistency: total_keys=2, already_sent=1, remote_indexes=2, expected=1".into())
    );
    assert!(placement(2, &old).is_err());
}
