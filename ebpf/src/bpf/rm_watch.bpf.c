// SPDX-License-Identifier: GPL-2.0 OR MIT
//
// rm_watch: reports the NVIDIA resource-manager objects processes create and free.
//
// sys_enter_ioctl: an RM_ALLOC (NVOS21/NVOS64) or RM_FREE (NVOS00) request on a character
// device whose major is `device_major` stashes (arg pointer, request) per thread.
// sys_exit_ioctl: if the ioctl returned 0 and RM wrote status 0 into the struct, the struct
// (and, for device/subdevice allocs, the first u32 of the alloc params) goes to the ring buffer.
// sched_process_exit: the exit of a whole thread group.
//
// No vmlinux.h: the few kernel structs walked are declared below with preserve_access_index,
// so libbpf relocates every field offset against the running kernel's BTF (CO-RE).

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// ---- load-time settings (rodata, set by the loader before load) ----

// Major number of the watched character devices (nvidiactl and nvidia<N> are 195).
const volatile __u32 device_major = 195;
// TEST ONLY: also report ioctls that returned -ENOTTY (what a device without an ioctl
// handler answers). Lets CI drive the real program with RM-shaped ioctls on /dev/null.
const volatile __u8 accept_enotty = 0;
// Flags for bpf_ringbuf_output: 0 wakes the consumer per event (adaptive), BPF_RB_NO_WAKEUP
// leaves the wake-up out of the ioctl path and lets the consumer drain on its own interval.
const volatile __u64 ringbuf_flags = 0;

// ---- RM ABI ----

#define RM_IOC_ALLOC_NVOS21 0xC020462Bu // _IOWR('F', 0x2B, 32)
#define RM_IOC_ALLOC_NVOS64 0xC030462Bu // _IOWR('F', 0x2B, 48)
#define RM_IOC_FREE_NVOS00 0xC0104629u  // _IOWR('F', 0x29, 16)

#define NV01_DEVICE_0 0x0080u
#define NV20_SUBDEVICE_0 0x2080u

#define ENOTTY 25
#define S_IFMT 00170000
#define S_IFCHR 0020000
#define MINORBITS 20

// ---- event sent to user space (mirrored in src/event.rs) ----

#define RM_EVENT_ALLOC 1
#define RM_EVENT_FREE 2
#define RM_EVENT_EXIT 3

#define RM_EVENT_F_NVOS64 1u      // alloc used the 48-byte NVOS64 form
#define RM_EVENT_F_EXTRA_VALID 2u // `extra` holds the first u32 of the alloc params

struct rm_event {
	__u64 ts_ns;
	__u32 kind;
	__u32 pid; // tgid
	__u32 tid;
	__u32 h_root;
	__u32 h_parent;
	__u32 h_object;
	__u32 h_class;
	__u32 extra;
	__u32 minor; // minor number of the device file the ioctl went to
	__u32 flags;
};
_Static_assert(sizeof(struct rm_event) == 48, "RAW_EVENT_SIZE in src/event.rs");

// ---- minimal kernel types (CO-RE) ----

struct inode {
	unsigned short i_mode;
	__u32 i_rdev;
} __attribute__((preserve_access_index));

struct file {
	struct inode *f_inode;
} __attribute__((preserve_access_index));

struct fdtable {
	unsigned int max_fds;
	struct file **fd;
} __attribute__((preserve_access_index));

struct files_struct {
	struct fdtable *fdt;
} __attribute__((preserve_access_index));

typedef struct {
	int counter;
} atomic_t;

struct signal_struct {
	atomic_t live;
} __attribute__((preserve_access_index));

struct task_struct {
	struct files_struct *files;
	struct signal_struct *signal;
} __attribute__((preserve_access_index));

// Tracepoint contexts: the fixed layout of syscall tracepoints (8-byte common header,
// int __syscall_nr, then each argument in 8 bytes).
struct ioctl_enter_ctx {
	__u64 common;
	__s32 syscall_nr;
	__u32 pad;
	__u64 fd;
	__u64 cmd;
	__u64 arg;
};

struct ioctl_exit_ctx {
	__u64 common;
	__s32 syscall_nr;
	__u32 pad;
	__s64 ret;
};

// sched_process_exit has carried `group_dead` since 6.16; older kernels lack the field.
struct trace_event_raw_sched_process_exit {
	char comm[16];
	int pid;
	int prio;
	_Bool group_dead;
} __attribute__((preserve_access_index));

// ---- maps ----

struct pending {
	__u64 arg;
	__u32 cmd;
	__u32 minor;
};

struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 16384);
	__type(key, __u32); // tid
	__type(value, struct pending);
} pending SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 20);
} events SEC(".maps");

#define STAT_RINGBUF_FULL 0
#define STAT_READ_FAILED 1
#define STAT_RM_STATUS_NONZERO 2
#define STAT_MAX 3

struct {
	__uint(type, BPF_MAP_TYPE_PERCPU_ARRAY);
	__uint(max_entries, STAT_MAX);
	__type(key, __u32);
	__type(value, __u64);
} stats SEC(".maps");

static __always_inline void count(__u32 which)
{
	__u64 *v = bpf_map_lookup_elem(&stats, &which);
	if (v)
		*v += 1;
}

// Returns the minor of fd's inode if it is a character device of major `device_major`,
// or -1.
static __always_inline long watched_minor(unsigned int fd)
{
	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	struct fdtable *fdt = BPF_CORE_READ(task, files, fdt);
	if (!fdt)
		return -1;
	if (fd >= BPF_CORE_READ(fdt, max_fds))
		return -1;
	struct file **fds = BPF_CORE_READ(fdt, fd);
	struct file *file = NULL;
	if (bpf_probe_read_kernel(&file, sizeof(file), &fds[fd]) || !file)
		return -1;
	struct inode *inode = BPF_CORE_READ(file, f_inode);
	if (!inode)
		return -1;
	if ((BPF_CORE_READ(inode, i_mode) & S_IFMT) != S_IFCHR)
		return -1;
	__u32 rdev = BPF_CORE_READ(inode, i_rdev);
	if ((rdev >> MINORBITS) != device_major)
		return -1;
	return rdev & ((1u << MINORBITS) - 1);
}

SEC("tracepoint/syscalls/sys_enter_ioctl")
int rm_ioctl_enter(struct ioctl_enter_ctx *ctx)
{
	__u32 cmd = (__u32)ctx->cmd;
	if (cmd != RM_IOC_ALLOC_NVOS64 && cmd != RM_IOC_ALLOC_NVOS21 && cmd != RM_IOC_FREE_NVOS00)
		return 0;
	long minor = watched_minor((unsigned int)ctx->fd);
	if (minor < 0)
		return 0;
	__u32 tid = (__u32)bpf_get_current_pid_tgid();
	struct pending p = { .arg = ctx->arg, .cmd = cmd, .minor = (__u32)minor };
	bpf_map_update_elem(&pending, &tid, &p, BPF_ANY);
	return 0;
}

// User-space layouts (offsets in bytes):
// NVOS21 (32): hRoot 0, hObjectParent 4, hObjectNew 8, hClass 12, pAllocParms 16, paramsSize 24, status 28
// NVOS64 (48): ... pAllocParms 16, pRightsRequested 24, paramsSize 32, flags 36, status 40
// NVOS00 (16): hRoot 0, hObjectParent 4, hObjectOld 8, status 12
struct nvos_buf {
	__u32 w[12];
};

SEC("tracepoint/syscalls/sys_exit_ioctl")
int rm_ioctl_exit(struct ioctl_exit_ctx *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tid = (__u32)pid_tgid;
	struct pending *pp = bpf_map_lookup_elem(&pending, &tid);
	if (!pp)
		return 0;
	struct pending p = *pp;
	bpf_map_delete_elem(&pending, &tid);

	if (ctx->ret != 0 && !(accept_enotty && ctx->ret == -ENOTTY))
		return 0;

	struct nvos_buf b = {};
	long err;
	__u32 status;
	struct rm_event ev = {};
	if (p.cmd == RM_IOC_FREE_NVOS00) {
		err = bpf_probe_read_user(&b, 16, (void *)p.arg);
		status = b.w[3];
		ev.kind = RM_EVENT_FREE;
	} else if (p.cmd == RM_IOC_ALLOC_NVOS64) {
		err = bpf_probe_read_user(&b, 48, (void *)p.arg);
		status = b.w[10];
		ev.kind = RM_EVENT_ALLOC;
		ev.flags = RM_EVENT_F_NVOS64;
	} else {
		err = bpf_probe_read_user(&b, 32, (void *)p.arg);
		status = b.w[7];
		ev.kind = RM_EVENT_ALLOC;
	}
	if (err) {
		count(STAT_READ_FAILED);
		return 0;
	}
	if (status != 0) {
		count(STAT_RM_STATUS_NONZERO);
		return 0;
	}

	ev.ts_ns = bpf_ktime_get_ns();
	ev.pid = (__u32)(pid_tgid >> 32);
	ev.tid = tid;
	ev.h_root = b.w[0];
	ev.h_parent = b.w[1];
	ev.h_object = b.w[2];
	ev.minor = p.minor;
	if (ev.kind == RM_EVENT_ALLOC) {
		ev.h_class = b.w[3];
		if (ev.h_class == NV01_DEVICE_0 || ev.h_class == NV20_SUBDEVICE_0) {
			__u64 params = (__u64)b.w[4] | ((__u64)b.w[5] << 32);
			__u32 size = (ev.flags & RM_EVENT_F_NVOS64) ? b.w[8] : b.w[6];
			__u32 first = 0;
			// CUDA 13 passes the params pointer with paramsSize 0 (RM knows each
			// class's size): measured on the H100, see hwtests/ioctl-logger.
			if (params && (size == 0 || size >= 4) &&
			    bpf_probe_read_user(&first, sizeof(first), (void *)params) == 0) {
				ev.extra = first;
				ev.flags |= RM_EVENT_F_EXTRA_VALID;
			}
		}
	}
	if (bpf_ringbuf_output(&events, &ev, sizeof(ev), ringbuf_flags))
		count(STAT_RINGBUF_FULL);
	return 0;
}

SEC("tracepoint/sched/sched_process_exit")
int rm_process_exit(struct trace_event_raw_sched_process_exit *ctx)
{
	int group_dead;
	if (bpf_core_field_exists(ctx->group_dead)) {
		group_dead = BPF_CORE_READ(ctx, group_dead);
	} else {
		struct task_struct *task = (struct task_struct *)bpf_get_current_task();
		group_dead = BPF_CORE_READ(task, signal, live.counter) == 0;
	}
	if (!group_dead)
		return 0;
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	struct rm_event ev = {
		.ts_ns = bpf_ktime_get_ns(),
		.kind = RM_EVENT_EXIT,
		.pid = (__u32)(pid_tgid >> 32),
		.tid = (__u32)pid_tgid,
	};
	if (bpf_ringbuf_output(&events, &ev, sizeof(ev), ringbuf_flags))
		count(STAT_RINGBUF_FULL);
	return 0;
}
