// SPDX-License-Identifier: GPL-2.0 OR MIT
//
// arrival_watch: sees request data arrive for the online service before any GPU work starts.
//
// tp_btf/sk_data_ready fires when a socket's receive path has made new data readable (for TCP,
// in tcp_data_ready, before the application is woken). The program looks up the socket's local
// port in `ports` (an array indexed by port); for a watched TCP port with unread bytes it counts
// the arrival and, the first time after `edge_gap_ns` without one, reports an edge to a ring
// buffer. A tracepoint cannot drop or hold a packet: this only observes.

#include <linux/types.h>
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>

char LICENSE[] SEC("license") = "Dual MIT/GPL";

// An arrival this long (ns) after the port's previous one is an idle->busy edge.
const volatile __u64 edge_gap_ns = 200000;

#define IPPROTO_TCP 6
#define TCP_LISTEN 10
#define RCV_SHUTDOWN 1

// ---- minimal kernel types (CO-RE) ----

struct ns_common {
	unsigned int inum;
} __attribute__((preserve_access_index));

struct net {
	struct ns_common ns;
} __attribute__((preserve_access_index));

typedef struct {
	struct net *net;
} possible_net_t;

struct sock_common {
	__u16 skc_num;
	unsigned short skc_family;
	volatile unsigned char skc_state;
	possible_net_t skc_net;
} __attribute__((preserve_access_index));

struct sock {
	struct sock_common __sk_common;
	__u16 sk_protocol;
	__u8 sk_shutdown;
} __attribute__((preserve_access_index));

struct tcp_sock {
	__u32 rcv_nxt;
	__u32 copied_seq;
} __attribute__((preserve_access_index));

// ---- maps ----

// Per local port (the index). `netns` 0 watches the port in every network namespace, otherwise
// only in the one with that inode number.
struct port_state {
	__u32 enabled;
	__u32 netns;
	__u64 last_ns;
	__u64 arrivals;
	__u64 edges;
};

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, struct port_state);
} ports SEC(".maps");

// Mirrored in src/arrival.rs (RAW_EDGE_SIZE).
struct arrival_edge {
	__u64 ts_ns;
	__u64 idle_ns; // since the port's previous arrival (0: the first one seen)
	__u32 port;
	__u32 netns;
};

struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 1 << 16);
} edges SEC(".maps");

SEC("tp_btf/sk_data_ready")
int arrival(__u64 *ctx)
{
	struct sock *sk = (struct sock *)ctx[0];
	__u32 port = sk->__sk_common.skc_num;
	struct port_state *p = bpf_map_lookup_elem(&ports, &port);
	if (!p || !p->enabled)
		return 0;
	// A listener's data_ready is a new connection, not data; a port may also be UDP.
	if (sk->sk_protocol != IPPROTO_TCP || sk->__sk_common.skc_state == TCP_LISTEN)
		return 0;
	__u32 netns = sk->__sk_common.skc_net.net->ns.inum;
	if (p->netns && p->netns != netns)
		return 0;
	// Only data counts: a FIN also wakes the reader but adds one sequence number, no byte.
	struct tcp_sock *tp = bpf_skc_to_tcp_sock(sk);
	if (!tp)
		return 0;
	__u32 unread = tp->rcv_nxt - tp->copied_seq;
	if (sk->sk_shutdown & RCV_SHUTDOWN)
		unread -= 1;
	if ((__s32)unread <= 0)
		return 0;
	__u64 now = bpf_ktime_get_ns();
	__u64 last = p->last_ns;
	p->last_ns = now;
	__sync_fetch_and_add(&p->arrivals, 1);
	if (last == 0 || now - last >= edge_gap_ns) {
		__sync_fetch_and_add(&p->edges, 1);
		struct arrival_edge e = {
			.ts_ns = now,
			.idle_ns = last ? now - last : 0,
			.port = port,
			.netns = netns,
		};
		bpf_ringbuf_output(&edges, &e, sizeof(e), 0);
	}
	return 0;
}
