//! Where the codec's parallel loops run: rayon's pool, or a team of threads lent by the caller.
//!
//! Every parallel loop of the crate is a list of independent tasks (blocks, streams). By
//! default they run on rayon's pool (or the pool the caller has installed). A caller that
//! already keeps a team of threads busy between codec calls can lend it instead
//! ([`with_team`]): the bindings lend torch's OpenMP team, whose threads spin between torch's
//! parallel regions and would otherwise take the cores that rayon's workers need.
//!
//! A loop nested inside a team's task runs on that task's thread, in order: a team is a fixed
//! set of threads, and the outer loop already has every one of them.

use std::cell::Cell;
use std::sync::Mutex;
use std::thread::LocalKey;

use rayon::prelude::*;

/// A fixed set of threads that runs a list of tasks.
pub trait Team: Sync {
    /// Threads of the team: [`Team::run`] passes thread indices below this.
    fn threads(&self) -> usize;

    /// Runs `task(thread, i)` for every `i < tasks`, each exactly once, spread over the team's
    /// threads (`thread` names the one running it, below [`Team::threads`], and no two tasks
    /// run on one thread at once). Returns when every task has run. A panic in a task is
    /// raised again here, after the others have run.
    fn run(&self, tasks: usize, task: &(dyn Fn(usize, usize) + Sync));
}

thread_local! {
    static TEAM: Cell<Option<&'static dyn Team>> = const { Cell::new(None) };
    static IN_TASK: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the crate's parallel loops on `team` (for the calling thread, until `f`
/// returns or panics).
pub fn with_team<R>(team: &'static dyn Team, f: impl FnOnce() -> R) -> R {
    with_cell(&TEAM, Some(team), f)
}

/// Runs `f` with the thread-local `cell` set to `value`, and sets it back after (on a panic
/// too).
fn with_cell<T: Copy + 'static, R>(
    cell: &'static LocalKey<Cell<T>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    struct Restore<T: Copy + 'static>(&'static LocalKey<Cell<T>>, T);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|c| c.set(self.1));
        }
    }
    let _restore = Restore(cell, cell.with(|c| c.replace(value)));
    f()
}

/// Runs `f` with the crate's parallel loops on the calling thread, in order (work that runs
/// beside a parallel loop and must not take part in it).
pub fn sequential<R>(f: impl FnOnce() -> R) -> R {
    with_cell(&IN_TASK, true, f)
}

enum Runner {
    Rayon,
    Team(&'static dyn Team),
    /// Inside a team's task.
    Here,
}

fn runner() -> Runner {
    if IN_TASK.with(Cell::get) {
        return Runner::Here;
    }
    match TEAM.with(Cell::get) {
        Some(team) if team.threads() > 1 => Runner::Team(team),
        Some(_) => Runner::Here,
        None => Runner::Rayon,
    }
}

/// Where a parallel loop started here would run: `("rayon", threads of the current pool)`,
/// `("team", threads)` or `("here", 1)` (inside a team's task, or a team of one thread).
pub fn describe() -> (&'static str, usize) {
    match runner() {
        Runner::Rayon => ("rayon", rayon::current_num_threads()),
        Runner::Team(team) => ("team", team.threads()),
        Runner::Here => ("here", 1),
    }
}

/// Runs `task` on `team`, marking its threads as inside a task so nested loops stay there.
fn run_on(team: &dyn Team, tasks: usize, task: impl Fn(usize, usize) + Sync) {
    team.run(tasks, &|thread, i| {
        with_cell(&IN_TASK, true, || task(thread, i))
    });
}

/// `[f(&mut state, i) for i in 0..n]`, in order; each thread makes its `state` once with
/// `init` (a scratch buffer, say) and reuses it across its tasks.
pub fn map_init<S: Send, R: Send>(
    n: usize,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize) -> R + Sync + Send,
) -> Vec<R> {
    match runner() {
        Runner::Rayon => (0..n).into_par_iter().map_init(init, f).collect(),
        Runner::Here => {
            let mut s = init();
            (0..n).map(|i| f(&mut s, i)).collect()
        }
        Runner::Team(team) => {
            let states: Vec<Mutex<Option<S>>> =
                (0..team.threads()).map(|_| Mutex::new(None)).collect();
            let slots: Vec<Mutex<Option<R>>> = (0..n).map(|_| Mutex::new(None)).collect();
            run_on(team, n, |thread, i| {
                // Each thread holds its own state: the lock is never contended.
                let mut state = states[thread].lock().unwrap_or_else(|e| e.into_inner());
                let r = f(state.get_or_insert_with(&init), i);
                let mut slot = slots[i].lock().unwrap_or_else(|e| e.into_inner());
                assert!(slot.replace(r).is_none(), "task {i} ran twice");
            });
            slots
                .into_iter()
                .enumerate()
                .map(|(i, s)| {
                    let r = s.into_inner().unwrap_or_else(|e| e.into_inner());
                    r.unwrap_or_else(|| panic!("task {i} never ran"))
                })
                .collect()
        }
    }
}

/// `[f(i) for i in 0..n]`, in order.
pub fn map<R: Send>(n: usize, f: impl Fn(usize) -> R + Sync + Send) -> Vec<R> {
    map_init(n, || (), |_, i| f(i))
}

/// `[f(i, chunk) for the i-th chunk of `chunk` items of data]`, in order (the last chunk may
/// be shorter).
pub fn map_chunks<T: Send, R: Send>(
    data: &mut [T],
    chunk: usize,
    f: impl Fn(usize, &mut [T]) -> R + Sync + Send,
) -> Vec<R> {
    assert!(chunk > 0, "chunks of zero items");
    map_init_parts(data.chunks_mut(chunk).collect(), || (), |_, i, c| f(i, c))
}

/// `[f(state, i, part) for the i-th of parts]`, in order, with a `state` from `init` per
/// thread (as [`map_init`]): the parts of one buffer that tasks fill, where a vector of its
/// own per task would be an allocation per task.
pub fn map_init_parts<T: Send, S: Send, R: Send>(
    parts: Vec<&mut [T]>,
    init: impl Fn() -> S + Sync + Send,
    f: impl Fn(&mut S, usize, &mut [T]) -> R + Sync + Send,
) -> Vec<R> {
    match runner() {
        Runner::Rayon => parts
            .into_par_iter()
            .enumerate()
            .map_init(init, |s, (i, p)| f(s, i, p))
            .collect(),
        Runner::Here => {
            let mut s = init();
            parts
                .into_iter()
                .enumerate()
                .map(|(i, p)| f(&mut s, i, p))
                .collect()
        }
        Runner::Team(_) => {
            // One lock per part, each taken by one task only: a way to hand the parts out.
            let parts: Vec<Mutex<&mut [T]>> = parts.into_iter().map(Mutex::new).collect();
            map_init(parts.len(), init, |s, i| {
                let mut p = parts[i].lock().unwrap_or_else(|e| e.into_inner());
                f(s, i, &mut p)
            })
        }
    }
}

/// `data` cut into consecutive parts of `lens` items (which must add up to at most its
/// length).
pub fn split_parts<T>(mut data: &mut [T], lens: impl IntoIterator<Item = usize>) -> Vec<&mut [T]> {
    lens.into_iter()
        .map(|n| {
            let (part, rest) = std::mem::take(&mut data).split_at_mut(n);
            data = rest;
            part
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicUsize, Ordering};

    use super::*;

    /// A team of scoped OS threads taking task indices from a counter: what a lent team does.
    struct Scoped(usize);

    impl Team for Scoped {
        fn threads(&self) -> usize {
            self.0
        }

        fn run(&self, tasks: usize, task: &(dyn Fn(usize, usize) + Sync)) {
            let next = AtomicUsize::new(0);
            std::thread::scope(|s| {
                for thread in 0..self.0 {
                    let next = &next;
                    s.spawn(move || loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= tasks {
                            break;
                        }
                        task(thread, i);
                    });
                }
            });
        }
    }

    static THREE: Scoped = Scoped(3);
    static ONE: Scoped = Scoped(1);

    fn square_all() -> Vec<usize> {
        map(50, |i| i * i)
    }

    #[test]
    fn every_runner_gives_the_same_results_in_order() {
        let want: Vec<usize> = (0..50).map(|i| i * i).collect();
        assert_eq!(square_all(), want);
        assert_eq!(with_team(&THREE, square_all), want);
        assert_eq!(with_team(&ONE, square_all), want);
        // The team is the caller's only while `with_team` runs.
        assert_eq!(with_team(&THREE, describe), ("team", 3));
        assert_eq!(with_team(&ONE, describe), ("here", 1));
        assert_eq!(describe().0, "rayon");
    }

    #[test]
    fn a_team_runs_each_task_once_with_one_state_per_thread() {
        let inits = AtomicUsize::new(0);
        let out = with_team(&THREE, || {
            map_init(
                200,
                || {
                    inits.fetch_add(1, Ordering::Relaxed);
                    Vec::<usize>::new()
                },
                |seen, i| {
                    seen.push(i);
                    // A thread's state only ever saw its own, increasing tasks.
                    assert!(seen.windows(2).all(|w| w[0] < w[1]));
                    i + 1
                },
            )
        });
        assert_eq!(out, (1..=200).collect::<Vec<_>>());
        assert!(inits.load(Ordering::Relaxed) <= 3);
    }

    #[test]
    fn loops_nested_in_a_team_task_run_on_its_thread() {
        let out = with_team(&THREE, || {
            map(4, |i| {
                assert!(matches!(runner(), Runner::Here));
                map(3, |j| 10 * i + j)
            })
        });
        assert_eq!(out[3], vec![30, 31, 32]);
    }

    /// `f()` on rayon, on a team of three and on a team of one, in that order.
    fn on_every_runner<R>(f: impl Fn() -> R) -> [R; 3] {
        [f(), with_team(&THREE, &f), with_team(&ONE, &f)]
    }

    #[test]
    fn chunks_cover_the_data_in_order() {
        let runs = on_every_runner(|| {
            let mut v = vec![0usize; 10];
            let lens = map_chunks(&mut v, 4, |i, c| {
                c.iter_mut().for_each(|x| *x = i + 1);
                c.len()
            });
            (v, lens)
        });
        for (v, lens) in runs {
            assert_eq!(v, [1, 1, 1, 1, 2, 2, 2, 2, 3, 3]);
            assert_eq!(lens, [4, 4, 2]);
        }
    }

    #[test]
    fn parts_of_any_lengths_are_filled_in_order_by_every_runner() {
        let runs = on_every_runner(|| {
            let mut v = vec![0usize; 12];
            let parts = split_parts(&mut v, [3, 0, 5, 2]);
            let lens = map_init_parts(
                parts,
                || (),
                |_, i, p| {
                    p.iter_mut().for_each(|x| *x = i + 1);
                    p.len()
                },
            );
            (v, lens)
        });
        for (v, lens) in runs {
            // The last two items were in no part.
            assert_eq!(v, [1, 1, 1, 3, 3, 3, 3, 3, 4, 4, 0, 0]);
            assert_eq!(lens, [3, 0, 5, 2]);
        }
    }
}
