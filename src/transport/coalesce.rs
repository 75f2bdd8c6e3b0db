//! Coalescing: runs of writes that are contiguous both locally and remotely
//! become one write.

use super::WriteOp;

/// Merges each run of consecutive ops in `ops` that go to the same peer, read
/// the same local region, and whose local and remote ranges both continue exactly where the previous op
/// of the run ended, into one op.
///
/// Clears `out` and `runs`, then fills them in parallel: `out[i]` is a merged
/// op and `runs[i]` how many consecutive input ops it covers, so `out[i]`
/// covers `ops[s..s + runs[i]]` with `s = runs[..i].sum()`. A merged op keeps
/// the `work_id` of the first op of its run and its `len` is the sum of the
/// run's lengths. To map a completion back, the caller keeps `runs` (or, if
/// its work ids are dense, recomputes them from the first `work_id`).
///
/// Only *adjacent* ops merge (never across an op of another peer), which keeps
/// each merged op a contiguous range of the input. Ops whose end would
/// overflow `u64` are never merged. Writing the merged ops writes exactly the
/// same bytes as writing the input ops.
pub fn coalesce(ops: &[WriteOp], out: &mut Vec<WriteOp>, runs: &mut Vec<usize>) {
    out.clear();
    runs.clear();
    for op in ops {
        if let (Some(last), Some(run)) = (out.last_mut(), runs.last_mut()) {
            if continues(last, op) {
                last.len += op.len;
                *run += 1;
                continue;
            }
        }
        out.push(*op);
        runs.push(1);
    }
}

/// True if `next` continues `prev` locally and remotely on the same peer.
fn continues(prev: &WriteOp, next: &WriteOp) -> bool {
    prev.peer == next.peer
        && prev.local_region == next.local_region
        && prev.local_offset.checked_add(prev.len) == Some(next.local_offset)
        && prev.remote_offset.checked_add(prev.len) == Some(next.remote_offset)
        && prev.len.checked_add(next.len).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(work_id: u64, local: u64, remote: u64, len: u64, peer: u32) -> WriteOp {
        WriteOp {
            work_id,
            local_offset: local,
            remote_offset: remote,
            len,
            peer,
            local_region: 0,
        }
    }

    #[test]
    fn merges_only_adjacent_contiguous_runs() {
        let ops = [
            op(1, 0, 100, 10, 0),
            op(2, 10, 110, 10, 0), // continues 1
            op(3, 20, 130, 10, 0), // remote gap
            op(4, 30, 140, 10, 1), // other peer
            op(5, 40, 150, 10, 1), // continues 4
            op(6, 50, 160, 10, 0), // peer changes back
            op(7, 70, 170, 10, 0), // local gap
        ];
        let (mut out, mut runs) = (Vec::new(), Vec::new());
        coalesce(&ops, &mut out, &mut runs);
        assert_eq!(runs, vec![2, 1, 2, 1, 1]);
        assert_eq!(out[0], op(1, 0, 100, 20, 0));
        assert_eq!(out[2], op(4, 30, 140, 20, 1));
        assert_eq!(runs.iter().sum::<usize>(), ops.len());
        // Reuse clears.
        coalesce(&[], &mut out, &mut runs);
        assert!(out.is_empty() && runs.is_empty());
    }

    #[test]
    fn never_merges_across_overflow() {
        let ops = [op(1, u64::MAX - 1, 0, 1, 0), op(2, u64::MAX, 1, 1, 0)];
        let (mut out, mut runs) = (Vec::new(), Vec::new());
        coalesce(&ops, &mut out, &mut runs);
        assert_eq!(runs, vec![2]); // MAX-1 + 1 == MAX: contiguous, merges
        let ops = [op(1, 0, 0, u64::MAX, 0), op(2, u64::MAX, u64::MAX, 1, 0)];
        coalesce(&ops, &mut out, &mut runs);
        assert_eq!(runs, vec![1, 1]);
    }

    #[test]
    fn never_merges_across_local_regions() {
        let mut b = op(2, 10, 10, 10, 0);
        b.local_region = 3;
        let mut c = op(3, 20, 20, 10, 0);
        c.local_region = 3;
        let (mut out, mut runs) = (Vec::new(), Vec::new());
        coalesce(&[op(1, 0, 0, 10, 0), b, c], &mut out, &mut runs);
        assert_eq!(runs, vec![1, 2]);
        assert_eq!(out[1].local_region, 3);
    }
}
