// SPDX-License-Identifier: GPL-2.0 OR MIT
//
// launch_watch: counts CUDA work submissions of processes by uprobes on libcuda's exported launch
// entry points (kernel launches and graph launches, every variant), and reports the first launch
// after an idle gap (the online process's idle->busy edge) to a ring buffer.
//
// It also tracks host threads waiting for their GPU work (uprobe + uretprobe on the synchronising
// entry points): while one waits, the process's GPU is busy even though it launches nothing, and
// the wait's end (the GPU work is done) is activity too. A launch is an edge only when no thread
// is waiting and the process has been idle (no launch, no wait ending) for the edge gap.
//
// The gate also arms `resumed` just before it resumes offline: a process's first launch after
// that time is an edge whatever the idle rule says, so no online launch can run beside resumed
// offline work unreported (a short wait just before it, or a thread still waiting, would
// otherwise hide it). Such an edge carries KIND_AFTER_RESUME when the idle rule alone would not
// have reported it.
//
// While the gate holds offline frozen (`held` later than `resumed`), an edge asks nothing of it
// at once, so it is written without waking the reader: the wake-up, taken inside the launch
// call, cost the launching thread ~20 us. The reader drains such edges within its poll period.
// Every other edge forces the wake-up: one that only woke an idle reader would not wake it while
// held edges wait unread.
//
// The attach cookie says which kind of entry point fired (1 kernel launch, 2 graph launch).

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// Only count processes in `watched` (when nonzero), else every process using libcuda.
const volatile __u8 filter_pids = 0;
// A launch this long (ns) after the process's previous one is an idle->busy edge.
const volatile __u64 edge_gap_ns = 1000000;

#define KIND_KERNEL 1
#define KIND_GRAPH 2
// Flag on an edge's kind: reported only because it is the first launch after a resume.
#define KIND_AFTER_RESUME 0x100
// Flag on an edge's kind: written while offline was held, without waking the reader.
#define KIND_QUIET 0x200

// Read field by field in src/launch.rs (parse_counts).
struct launch_stats {
	__u64 kernel_launches;
	__u64 graph_launches;
	__u64 last_ns; // latest launch or end of a wait (activity)
	__u64 edges;
	__s64 in_sync; // threads inside a synchronising call now
	__u64 syncs;   // synchronising calls entered
	__u64 sync_end_ns;
	__u64 last_launch_ns; // latest launch (not the end of a wait)
	__u64 quiet_edges;    // edges written without waking the reader (offline held)
	__u64 edge_prev_ns;   // the activity before the latest edge (0: none)
	__u64 last_edge_ns;   // the latest edge
};

struct launch_edge {
	__u32 pid;
	__u32 kind;
	__u64 ts_ns;
	__u64 idle_ns; // gap since the previous launch (0 for a process's first launch)
};

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, __u8);
} watched SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 4096);
	__type(key, __u32);
	__type(value, struct launch_stats);
} stats SEC(".maps");

// CLOCK_MONOTONIC ns at which the gate last resumed offline (0: never), written by user space.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} resumed SEC(".maps");

// CLOCK_MONOTONIC ns since which the gate holds offline frozen (0: it does not), written by user
// space; it counts only while later than `resumed`.
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 1);
	__type(key, __u32);
	__type(value, __u64);
} held SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 16);
} edges SEC(".maps");

// The counters of the calling process, created on first use; NULL if it is not watched.
static __always_inline struct launch_stats *stats_of(__u32 pid)
{
	if (filter_pids && !bpf_map_lookup_elem(&watched, &pid))
		return 0;
	struct launch_stats *s = bpf_map_lookup_elem(&stats, &pid);
	if (!s) {
		struct launch_stats zero = {};
		bpf_map_update_elem(&stats, &pid, &zero, BPF_NOEXIST);
		s = bpf_map_lookup_elem(&stats, &pid);
	}
	return s;
}

// Each program below exists twice: as a uprobe, attached once per symbol (any kernel), and as
// a uprobe.multi, attached to every symbol of one process in one link (Linux 6.6 and later):
// removing one multi link waits for one grace period, not one per symbol.
static __always_inline int sync_enter(void)
{
	struct launch_stats *s = stats_of(bpf_get_current_pid_tgid() >> 32);
	if (!s)
		return 0;
	__sync_fetch_and_add(&s->in_sync, 1);
	__sync_fetch_and_add(&s->syncs, 1);
	return 0;
}

static __always_inline int sync_exit(void)
{
	__u32 pid = bpf_get_current_pid_tgid() >> 32;
	if (filter_pids && !bpf_map_lookup_elem(&watched, &pid))
		return 0;
	struct launch_stats *s = bpf_map_lookup_elem(&stats, &pid);
	if (!s)
		return 0;
	// A wait that began before the process was watched has no matching enter.
	if (s->in_sync > 0)
		__sync_fetch_and_add(&s->in_sync, -1);
	__u64 now = bpf_ktime_get_ns();
	s->sync_end_ns = now;
	s->last_ns = now;
	return 0;
}

static __always_inline int launch(__u64 kind)
{
	__u32 pid = bpf_get_current_pid_tgid() >> 32;
	struct launch_stats *s = stats_of(pid);
	if (!s)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	__u64 last = s->last_ns;
	if (kind == KIND_GRAPH)
		__sync_fetch_and_add(&s->graph_launches, 1);
	else
		__sync_fetch_and_add(&s->kernel_launches, 1);
	s->last_ns = now;
	__u64 prev_launch = s->last_launch_ns;
	s->last_launch_ns = now;
	__u32 zero = 0;
	__u64 *resumed_at = bpf_map_lookup_elem(&resumed, &zero);
	__u64 resumed_ns = resumed_at ? *resumed_at : 0;
	int idle_edge = s->in_sync <= 0 && (last == 0 || now - last >= edge_gap_ns);
	int resume_edge = resumed_ns && prev_launch < resumed_ns;
	if (idle_edge || resume_edge) {
		__sync_fetch_and_add(&s->edges, 1);
		// An arrival between the two found the process idle since edge_prev_ns (the gate
		// reads both twice: a read between these stores is told by the second).
		s->edge_prev_ns = last;
		s->last_edge_ns = now;
		__u64 *held_at = bpf_map_lookup_elem(&held, &zero);
		int quiet = held_at && *held_at > resumed_ns;
		if (quiet)
			__sync_fetch_and_add(&s->quiet_edges, 1);
		struct launch_edge e = {
			.pid = pid,
			.kind = (__u32)kind | (idle_edge ? 0 : KIND_AFTER_RESUME) |
				(quiet ? KIND_QUIET : 0),
			.ts_ns = now,
			.idle_ns = last ? now - last : 0,
		};
		bpf_ringbuf_output(&edges, &e, sizeof(e),
				   quiet ? BPF_RB_NO_WAKEUP : BPF_RB_FORCE_WAKEUP);
	}
	return 0;
}

SEC("uprobe")
int cuda_sync_enter(void *ctx)
{
	return sync_enter();
}

SEC("uretprobe")
int cuda_sync_exit(void *ctx)
{
	return sync_exit();
}

SEC("uprobe")
int cuda_launch(void *ctx)
{
	return launch(bpf_get_attach_cookie(ctx));
}

SEC("uprobe.multi")
int cuda_sync_enter_multi(void *ctx)
{
	return sync_enter();
}

SEC("uretprobe.multi")
int cuda_sync_exit_multi(void *ctx)
{
	return sync_exit();
}

SEC("uprobe.multi")
int cuda_launch_multi(void *ctx)
{
	return launch(bpf_get_attach_cookie(ctx));
}
