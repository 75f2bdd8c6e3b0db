//! The seed document's deadlock example (buffer = 10 chunks, requests A and
//! B of 8 chunks each, allocating batch by batch), first without admission
//! (it deadlocks), then with the reservation ledger (both finish, B only
//! after A released).
#![cfg(not(feature = "shuttle-model"))]

use std::sync::{mpsc, Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

mod common_ledger;

use common_ledger::admit_blocking;
use kvferry::ledger::Ledger;
use kvferry::slots::SlotAllocator;

const HANG: Duration = Duration::from_secs(10);

/// Without admission: A takes 5, B takes 5, the buffer is full and neither
/// can take the 3 it still needs; nothing will ever be freed (the decoder
/// needs all 8 of a request). This is the seed's deadlock.
#[test]
fn per_batch_allocation_without_admission_deadlocks() {
    let buffer = SlotAllocator::new(10);
    let a1 = buffer.try_alloc(5).expect("A batch 1");
    let b1 = buffer.try_alloc(5).expect("B batch 1");
    assert!(buffer.try_alloc(3).is_none(), "A batch 2 cannot fit");
    assert!(buffer.try_alloc(3).is_none(), "B batch 2 cannot fit");
    assert_eq!(buffer.in_use(), 10);
    buffer.free(a1);
    buffer.free(b1);
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ev {
    Admitted(char),
    Batch(char, usize),
    Released(char),
}

/// A request: admit all 8 chunks first, then allocate the receive slots in
/// batches (5 then 3) - each allocation is guaranteed - then the decoder
/// consumes and frees them.
fn run_request(
    name: char,
    ledger: Ledger,
    buffer: SlotAllocator,
    log: Arc<Mutex<Vec<Ev>>>,
    after_first_batch: impl Fn(),
) -> Result<(), String> {
    let mut res = admit_blocking(&ledger, 8, Instant::now() + HANG)
        .map_err(|e| format!("{name}: admission failed: {e}"))?;
    log.lock().unwrap().push(Ev::Admitted(name));
    let mut sets = Vec::new();
    for batch in [5, 3] {
        res.allocate(batch).map_err(|e| format!("{name}: {e}"))?;
        // Guaranteed by admission: never blocks, never fails.
        let set = buffer
            .try_alloc(batch)
            .ok_or_else(|| format!("{name}: admitted allocation of {batch} failed"))?;
        log.lock().unwrap().push(Ev::Batch(name, batch));
        sets.push(set);
        if batch == 5 {
            after_first_batch();
        }
    }
    // transfer done, decoder consumes: slots and ledger chunks come back
    log.lock().unwrap().push(Ev::Released(name));
    for s in sets {
        let n = s.len();
        buffer.free(s);
        ledger.free(n);
    }
    Ok(())
}

#[test]
fn reservation_admission_makes_the_seed_example_finish() {
    let ledger = Ledger::new(10);
    let buffer = SlotAllocator::new(10);
    let log = Arc::new(Mutex::new(Vec::new()));
    let (done_tx, done_rx) = mpsc::channel();
    // A starts first; after its first batch it waits until B is queued in
    // the ledger, so B really runs (and waits) while A holds 8 chunks.
    let spawn = |name: char, after: Box<dyn Fn() + Send>| {
        let (l, b, g, d) = (ledger.clone(), buffer.clone(), log.clone(), done_tx.clone());
        thread::spawn(move || {
            let _ = d.send((name, run_request(name, l, b, g, after)));
        });
    };
    let l = ledger.clone();
    spawn(
        'A',
        Box::new(move || {
            let end = Instant::now() + HANG;
            while l.stats().waiters == 0 && Instant::now() < end {
                thread::sleep(Duration::from_millis(1));
            }
        }),
    );
    let end = Instant::now() + HANG;
    while ledger.stats().committed < 8 {
        assert!(Instant::now() < end, "A was never admitted");
        thread::sleep(Duration::from_millis(1));
    }
    spawn('B', Box::new(|| {}));
    for _ in 0..2 {
        let (name, r) = done_rx
            .recv_timeout(HANG)
            .expect("a request hung: the seed deadlock is back");
        r.unwrap_or_else(|e| panic!("request {name} failed: {e}"));
    }
    let log = log.lock().unwrap().clone();
    assert_eq!(
        log,
        vec![
            Ev::Admitted('A'),
            Ev::Batch('A', 5),
            Ev::Batch('A', 3),
            Ev::Released('A'),
            Ev::Admitted('B'),
            Ev::Batch('B', 5),
            Ev::Batch('B', 3),
            Ev::Released('B'),
        ],
        "B must be admitted only after A released"
    );
    assert_eq!(ledger.stats().committed, 0);
    assert_eq!(ledger.stats().waiters, 0);
    assert_eq!(buffer.in_use(), 0);
}
