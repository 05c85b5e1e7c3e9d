//! What each thread of a process is doing, read from `/proc`: the pool logs it just before it kills
//! an offline process that did not answer a reclaim, so the log says where that process was stuck.
//!
//! Per thread: its name, scheduler state, the kernel function it sleeps in (`wchan`), and its
//! system call with the first two arguments (for an `ioctl`, the descriptor and the request code,
//! which names the driver call). Everything is best effort: a field that cannot be read is `?`.

use std::fs;
use std::path::Path;

/// At most this many threads are read: the online grow behind the reclaim is waiting meanwhile.
pub const MAX_THREADS: usize = 64;

/// One thread's state, as `/proc/PID/task/TID` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadState {
    /// The thread's id.
    pub tid: u32,
    /// `comm` (for example `valve-client-cb`, the library's callback thread).
    pub name: String,
    /// The state letter of `stat` (R running, S sleeping, D uninterruptible, ...).
    pub state: char,
    /// The kernel function it waits in (`wchan`; `0` or empty while running).
    pub wchan: String,
    /// `syscall`'s number and first two arguments, or `running`.
    pub syscall: String,
}

/// The threads of `pid` (at most [`MAX_THREADS`], lowest thread ids first). Empty if the process
/// has gone or `/proc` cannot be read.
pub fn snapshot(pid: u32) -> Vec<ThreadState> {
    snapshot_in(Path::new("/proc"), pid)
}

fn snapshot_in(proc_root: &Path, pid: u32) -> Vec<ThreadState> {
    let task = proc_root.join(pid.to_string()).join("task");
    let Ok(entries) = fs::read_dir(&task) else {
        return Vec::new();
    };
    let mut tids: Vec<u32> = entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    tids.truncate(MAX_THREADS);
    tids.into_iter()
        .map(|tid| read_thread(&task.join(tid.to_string()), tid))
        .collect()
}

fn read_thread(dir: &Path, tid: u32) -> ThreadState {
    let read = |f: &str| fs::read_to_string(dir.join(f)).map(|s| s.trim().to_string());
    ThreadState {
        tid,
        name: read("comm").unwrap_or_else(|_| "?".into()),
        state: read("stat")
            .ok()
            .and_then(|s| stat_state(&s))
            .unwrap_or('?'),
        wchan: read("wchan").unwrap_or_else(|_| "?".into()),
        syscall: read("syscall").map_or_else(|_| "?".into(), |s| syscall_head(&s)),
    }
}

/// The state letter of a `stat` line: the field after the name, which is in parentheses and may
/// itself hold spaces and parentheses.
fn stat_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// `syscall` without the stack and instruction pointers: the number and the first two arguments
/// (`16 0x3 0xc020462a` is an ioctl on descriptor 3 with that request), or `running`.
fn syscall_head(line: &str) -> String {
    let fields: Vec<&str> = line.split_whitespace().collect();
    match fields.first() {
        Some(&"running") | None => "running".into(),
        Some(_) => fields[..fields.len().min(3)].join(" "),
    }
}

/// One line for the log: `tid name state wchan [syscall]` per thread, `; `-separated.
pub fn summary(threads: &[ThreadState]) -> String {
    if threads.is_empty() {
        return "no threads readable (the process has gone, or /proc is not readable)".into();
    }
    threads
        .iter()
        .map(|t| {
            format!(
                "{} {} {} {} [{}]",
                t.tid, t.name, t.state, t.wchan, t.syscall
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_state_letter_follows_the_last_parenthesis_of_the_name() {
        assert_eq!(stat_state("42 (python3) S 1 42"), Some('S'));
        assert_eq!(
            stat_state("42 (a) (b) D 1"),
            Some('D'),
            "a name with ') ' in it"
        );
        assert_eq!(stat_state("garbage"), None);
    }

    #[test]
    fn a_syscall_line_keeps_its_number_and_first_two_arguments() {
        let ioctl = "16 0x3 0xc020462a 0x7ffd 0x0 0x0 0x0 0x7ffc0000 0x7f00000000";
        assert_eq!(syscall_head(ioctl), "16 0x3 0xc020462a");
        assert_eq!(syscall_head("running"), "running");
        assert_eq!(syscall_head("-1 0x7ffc 0x7f00"), "-1 0x7ffc 0x7f00");
        assert_eq!(syscall_head(""), "running");
    }

    #[test]
    fn a_sleeping_child_is_read_by_name_with_its_system_call() {
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pid = child.id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let threads = loop {
            let t = snapshot(pid);
            let asleep = t
                .first()
                .is_some_and(|t| t.name == "sleep" && t.state == 'S');
            if asleep || std::time::Instant::now() > deadline {
                break t;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        };
        child.kill().unwrap();
        child.wait().unwrap();
        assert_eq!(threads.len(), 1, "{threads:?}");
        let t = &threads[0];
        assert_eq!(
            (t.tid, t.name.as_str(), t.state),
            (pid, "sleep", 'S'),
            "{t:?}"
        );
        // The syscall file needs ptrace rights over the child (a parent has them); its first field
        // is the call's number.
        let nr = t.syscall.split(' ').next().unwrap();
        assert!(nr.parse::<i64>().is_ok() || nr == "?", "{t:?}");
        assert!(summary(&threads).starts_with(&format!("{pid} sleep S ")));
    }

    #[test]
    fn a_process_that_has_gone_gives_no_threads_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        assert!(snapshot_in(dir.path(), 7).is_empty());
        assert!(summary(&[]).contains("has gone"));
    }

    #[test]
    fn unreadable_fields_are_question_marks_and_threads_are_capped() {
        let dir = tempfile::tempdir().unwrap();
        for tid in 0..(MAX_THREADS as u32 + 5) {
            let t = dir.path().join("9/task").join(tid.to_string());
            fs::create_dir_all(&t).unwrap();
            if tid == 1 {
                fs::write(t.join("comm"), "valve-client-cb\n").unwrap();
                fs::write(t.join("stat"), "1 (valve-client-cb) S 0").unwrap();
                fs::write(t.join("wchan"), "futex_wait_queue").unwrap();
                fs::write(t.join("syscall"), "202 0x7f10 0x80 0x0 0x0 0x0 0x0 0x1 0x2").unwrap();
            }
        }
        let threads = snapshot_in(dir.path(), 9);
        assert_eq!(threads.len(), MAX_THREADS);
        assert_eq!(threads[0].name, "?");
        assert_eq!(threads[0].state, '?');
        let cb = &threads[1];
        assert_eq!(
            (
                cb.name.as_str(),
                cb.state,
                cb.wchan.as_str(),
                cb.syscall.as_str()
            ),
            (
                "valve-client-cb",
                'S',
                "futex_wait_queue",
                "202 0x7f10 0x80"
            )
        );
    }
}
