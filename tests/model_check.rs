//! Model checks of the admission protocol (issue 6): every interleaving of
//! small configurations, with the real sender core
//! (`kvferry::sender::core`) and the real receiver core
//! (`kvferry::receiver::core::ReceiverCore`). See docs/model-check.md.
//!
//! `cargo test --test model_check` runs the CI configurations (seconds in
//! debug); `cargo test --release --test model_check -- --ignored` runs the
//! bigger ones.
#![cfg(not(feature = "shuttle-model"))]

mod model;

use std::time::Instant;

use stateright::{Checker, Model};

use model::config::{Cfg, Rules};
use model::Pd;

/// Explores every reachable state of `cfg` (BFS) and returns the checker.
fn check(cfg: Cfg) -> impl Checker<Pd> {
    let name = cfg.name;
    let t = Instant::now();
    let c = Pd { cfg }.checker().spawn_bfs().join();
    eprintln!(
        "{name}: {} unique states, {} generated, max depth {}, {:.2?}",
        c.unique_state_count(),
        c.state_count(),
        c.max_depth(),
        t.elapsed()
    );
    c
}

/// Every property holds for every interleaving.
fn expect_pass(cfg: Cfg) {
    let c = check(cfg);
    assert!(
        c.is_done(),
        "the checker must explore the whole state space"
    );
    c.assert_properties();
}

/// The checker finds a state where nothing can move while a request is
/// unfinished; prints the counterexample.
fn expect_deadlock(cfg: Cfg) {
    let c = check(cfg);
    let Some(path) = c.discovery("no deadlock") else {
        panic!("expected a deadlock counterexample, found none");
    };
    let model = c.model();
    let steps = path.clone().into_actions().len();
    eprintln!("counterexample ({steps} steps):");
    for (i, a) in path.clone().into_actions().iter().enumerate() {
        eprintln!("  {:2}. {a:?}", i + 1);
    }
    let last = path.last_state();
    eprintln!("stuck state: {}", model::describe(model, last));
    assert!(model.stuck(last) && !last.all_ended(&model.cfg));
}

fn kv(
    name: &'static str,
    cap: usize,
    staging: u8,
    senders: &[usize],
    sizes: &[u8],
    batch: u8,
) -> Cfg {
    Cfg::simple(
        name,
        cap,
        staging,
        senders,
        sizes,
        batch,
        &[],
        Rules::KVFERRY,
    )
}

// ----- kvferry's rules: every property holds -------------------------------

/// The seed's example scaled down: each request alone fits, both together do
/// not (capacity 5, requests of 4 chunks in batches of 2, staging 2).
#[test]
fn seed_one_sender_two_requests() {
    expect_pass(kv(
        "seed 1x2 (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 0],
        &[4, 4],
        2,
    ));
}

/// The seed's example at its own size: capacity 10, A 8 and B 8 chunks in
/// batches of 4, staging 4.
#[test]
fn seed_full_size() {
    expect_pass(kv(
        "seed 1x2 (cap 10, 8+8, batch 4, staging 4)",
        10,
        4,
        &[0, 0],
        &[8, 8],
        4,
    ));
}

/// 2P1D: two senders, one request each, sharing one receiver.
#[test]
fn two_senders_one_request_each() {
    expect_pass(kv(
        "2P1D (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 1],
        &[4, 4],
        2,
    ));
}

/// Two senders whose requests may be cancelled at any step.
#[test]
fn two_senders_with_aborts() {
    let cfg = Cfg::simple(
        "2P1D aborts (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 1],
        &[4, 4],
        2,
        &[true, true],
        Rules::KVFERRY,
    );
    expect_pass_aborts(cfg);
}

/// With aborts, "every request completes" is still reachable, and so are
/// cancellations; the safety and liveness properties hold.
fn expect_pass_aborts(cfg: Cfg) {
    let c = check(cfg);
    assert!(c.is_done());
    c.assert_properties();
}

/// A request larger than the sender's staging: 6 chunks through 2 staging
/// slots, next to a request of 3 (capacity 6: each fits alone, not both).
#[test]
fn request_larger_than_staging() {
    expect_pass(kv(
        "larger than staging (cap 6, 6+3, batch 2, staging 2)",
        6,
        2,
        &[0, 0],
        &[6, 3],
        2,
    ));
}

/// kvferry against an LMCache receiver (`Mode::Legacy`): one message
/// outstanding, one request at a time.
#[test]
fn legacy_mode_one_request_at_a_time() {
    let cfg = Cfg::simple(
        "kvferry legacy mode (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 0],
        &[4, 4],
        2,
        &[],
        Rules::KVFERRY_LEGACY,
    );
    expect_pass(cfg);
}

// ----- variants that deadlock ------------------------------------------------

/// LMCache's current design: staging taken before admission, one
/// outstanding AllocRequest per receiver, every batch sent in store order.
#[test]
fn lmcache_design_deadlocks() {
    let cfg = Cfg::simple(
        "LMCache rules (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 0],
        &[4, 4],
        2,
        &[],
        Rules::LMCACHE,
    );
    expect_deadlock(cfg);
}

/// kvferry's sender before the staging-order fix: an answered batch whose
/// bytes wait in the pending area blocks, at the head of the request's
/// queue, the staged batch behind it that holds all the staging.
#[test]
fn in_order_staging_deadlocks() {
    let cfg = Cfg::simple(
        "kvferry, in-order staging (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 0],
        &[4, 4],
        2,
        &[],
        Rules::KVFERRY_IN_ORDER_STAGING,
    );
    expect_deadlock(cfg);
}

/// Dedup: two senders' requests share one key (a common prefix chunk). The
/// second to arrive is told "already sent" for it and does not write it.
fn dedup_cfg(name: &'static str, rules: Rules, aborts: [bool; 2]) -> Cfg {
    let mut cfg = Cfg::simple(name, 6, 2, &[0, 1], &[3, 3], 2, &aborts, rules);
    // r1's first key is r0's first key.
    cfg.reqs[1].keys[0] = cfg.reqs[0].keys[0];
    cfg
}

/// Checks that every property holds except the `sometimes` properties
/// named in `unreached`, which this configuration cannot reach (and must
/// not: a listed property found reachable fails the check too).
fn expect_pass_except_unreached(cfg: Cfg, unreached: &[&str]) {
    let c = check(cfg);
    assert!(
        c.is_done(),
        "the checker must explore the whole state space"
    );
    let found = c.discoveries();
    for p in c.model().properties() {
        let name = p.name;
        let bad = match p.expectation {
            stateright::Expectation::Sometimes => !found.contains_key(name),
            _ => found.contains_key(name),
        };
        if unreached.contains(&name) {
            assert!(bad, "{name:?} is reachable after all");
        } else {
            assert!(
                !bad,
                "unexpected result for {name:?}: {:?}",
                found.get(name).map(|p| p.clone().into_actions())
            );
        }
    }
}

/// Dedup: every property holds. The receiver reports a key "already sent"
/// only once its writer's TransferDone arrived; a request that asks for it
/// while it is being written gets a slot of its own and writes its own copy
/// (docs/model-check.md, findings 2 and 3, fixed).
#[test]
fn dedup_shared_key() {
    expect_pass_except_unreached(
        dedup_cfg(
            "dedup (cap 6, 3+3 sharing 1 key, batch 2, staging 2)",
            Rules::KVFERRY,
            [false, false],
        ),
        // Capacity 6 admits both requests at once (that is what lets them
        // share the key concurrently), so nothing parks.
        &["a request waits parked at the receiver"],
    );
}

/// Dedup where r1 may be cancelled at any step. Either request may be the
/// first to allocate the shared key, so this covers an aborting first
/// writer (finding 3) and an aborting second request; it frees only its own
/// copy or pin.
#[test]
fn dedup_shared_key_one_abort() {
    expect_pass_except_unreached(
        dedup_cfg(
            "dedup, r1 may abort (cap 6, 3+3 sharing 1 key, batch 2, staging 2)",
            Rules::KVFERRY,
            [false, true],
        ),
        &["a request waits parked at the receiver"],
    );
}

/// Dedup where both requests may be cancelled at any step (bigger;
/// `--ignored`).
#[test]
#[ignore]
fn dedup_shared_key_with_aborts() {
    expect_pass_except_unreached(
        dedup_cfg(
            "dedup, both may abort (cap 6, 3+3 sharing 1 key, batch 2, staging 2)",
            Rules::KVFERRY,
            [true, true],
        ),
        &["a request waits parked at the receiver"],
    );
}

/// 2P1D with two requests per sender, scaled down until it finishes
/// (`--ignored`): capacity 1, requests of 1 chunk, staging 1. The same with
/// requests of 2 chunks (capacity 3, batches of 1) did not finish in 10
/// minutes (release, 1.5 GB): the receiver log makes every interleaving of
/// four requests' messages a distinct state.
#[test]
#[ignore]
fn two_senders_two_requests_each() {
    expect_pass(kv(
        "2P1D x2 (cap 1, 1+1+1+1, batch 1, staging 1)",
        1,
        1,
        &[0, 0, 1, 1],
        &[1, 1, 1, 1],
        1,
    ));
}

/// Which of LMCache's rules deadlocks on its own: only the per-receiver
/// lock (one outstanding AllocRequest, every batch sent in store order),
/// with kvferry's staging rule.
#[test]
fn lmcache_lock_alone_deadlocks() {
    let rules = Rules {
        stage_before_admission: false,
        stage_in_order: false,
        ..Rules::LMCACHE
    };
    let cfg = Cfg::simple(
        "LMCache lock only (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 0],
        &[4, 4],
        2,
        &[],
        rules,
    );
    expect_deadlock(cfg);
}

/// Only staging before admission, with kvferry's pipelined, seq-matched
/// AllocRequests: the parked request's staged batch starves the admitted one.
#[test]
fn lmcache_staging_alone_deadlocks() {
    let rules = Rules {
        stage_before_admission: true,
        ..Rules::KVFERRY
    };
    let cfg = Cfg::simple(
        "staging before admission only (cap 5, 4+4, batch 2, staging 2)",
        5,
        2,
        &[0, 0],
        &[4, 4],
        2,
        &[],
        rules,
    );
    expect_deadlock(cfg);
}
