/*
 * valve_client.h: the C ABI of valve-client (ctl/client), the library a framework's KV
 * allocator links to back its KV cache with the Valve daemon's GPU memory pool.
 *
 * Model (docs/memory.md, "The pool protocol"): a client registers with the daemon as online or
 * offline for one GPU, then creates one KV space: `regions` virtual ranges of equal size (one per
 * KV tensor). One pool handle backs one slot: piece i of the handle (handle_bytes / regions
 * bytes) is mapped into region i at offset slot * piece_bytes. KV block b lives at
 * [b * block_bytes, (b + 1) * block_bytes) in every region; slot s holds blocks
 * s * blocks_per_slot .. (s + 1) * blocks_per_slot - 1.
 *
 * Offline clients report which request owns each block (valve_client_set_block_owner) and,
 * once after each step, collect the blocks that reclaims invalidated
 * (valve_client_take_invalidated): their requests must be recomputed, and those blocks are not
 * to be handed out again until valve_client_grow returns their slots.
 *
 * Status codes: VALVE_OK (0); the daemon's codes (below 100); the library's (100 and up).
 * valve_client_last_error() describes the calling thread's last failure.
 * Calls on one client must not overlap; the library's callback thread is internal.
 * No function panics or throws across this boundary.
 */
#ifndef VALVE_CLIENT_H
#define VALVE_CLIENT_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct valve_client valve_client;

/* Roles. */
#define VALVE_ROLE_ONLINE 0
#define VALVE_ROLE_OFFLINE 1

/* valve_client_connect flags. */
#define VALVE_CLIENT_NO_PREMAP 1u        /* online: map handles when granted (serial mode) */
#define VALVE_CLIENT_FIFO 2u             /* offline: reclaim the oldest grants, not Algorithm 1 */
#define VALVE_CLIENT_EXPLICIT_RELEASE 4u /* offline: reclaimed slots are refilled only after
                                          * valve_client_release_quarantined */
#define VALVE_CLIENT_FAKE_GPU 0x80000000u /* tests only: no GPU, made-up addresses */

/* Status codes. */
#define VALVE_OK 0
#define VALVE_E_BAD_REQUEST 2      /* the daemon found the request malformed */
#define VALVE_E_TOO_LARGE 11       /* more than the GPU holds */
#define VALVE_E_POOL_EXHAUSTED 12  /* nothing free for this client (offline) */
#define VALVE_E_NOT_REGISTERED 13  /* unknown client or wrong token: connect again */
#define VALVE_E_NOT_HELD 14        /* a handle this client does not hold */
#define VALVE_E_WRONG_ROLE 15      /* the request is not for this role */
#define VALVE_E_INVALID 100        /* a bad argument (NULL pointer, slot not held, ...) */
#define VALVE_E_CONNECT 101        /* the daemon's socket cannot be reached */
#define VALVE_E_CLOSED 102         /* the daemon closed the connection */
#define VALVE_E_PROTOCOL 103       /* the daemon sent something this library does not understand */
#define VALVE_E_CUDA 104           /* a CUDA call failed */
#define VALVE_E_LAYOUT 105         /* regions or block size do not fit the pool's handles */
#define VALVE_E_NO_SPACE 106       /* the KV space has no room for what was asked */
#define VALVE_E_STATE 107          /* no KV space yet, or a second one */
#define VALVE_E_TIMEOUT 108        /* the daemon did not deliver lent handles in time */
#define VALVE_E_PANIC 199          /* a bug in the library */

typedef struct valve_kv_space_info {
    uint32_t regions;         /* virtual ranges */
    uint32_t slots;           /* slots per region */
    uint32_t blocks_per_slot; /* KV blocks per slot */
    uint32_t reserved;        /* 0 */
    uint64_t piece_bytes;     /* bytes of one handle in one region */
    uint64_t block_bytes;     /* bytes of one KV block in one region */
    uint64_t region_bytes;    /* bytes of each region */
    uint64_t handle_bytes;    /* bytes per pool handle */
} valve_kv_space_info;

typedef struct valve_stats {
    uint32_t held_slots;          /* slots backed by pool memory lent to this client */
    uint32_t mapped_slots;        /* slots with pool memory mapped (premapped online: the pool) */
    uint32_t quarantined_slots;   /* slots with the quarantine mapped */
    uint32_t pending_invalidated; /* invalidated blocks not collected yet */
    uint64_t reclaims;            /* reclaims answered */
    uint64_t reclaimed_handles;   /* handles given back in reclaims */
    uint64_t invalidated_blocks;  /* blocks invalidated by reclaims */
    uint64_t callback_errors;     /* callback messages that failed */
    uint32_t daemon_closed;       /* 1: the daemon closed the callback connection */
    uint32_t reserved;            /* 0 */
} valve_stats;

/* Connects to the pool socket (NULL: /run/valve/pool.sock) and registers as `role` on `gpu`
 * (an index, a GPU UUID or a PCI id). On success *out is the client. */
int valve_client_connect(const char *socket_path, int role, const char *gpu, uint32_t flags,
                         valve_client **out);

/* Creates the KV space (once): `regions` ranges of `capacity_bytes_per_region` each, rounded
 * down to whole pieces (0: as much as the pool holds; premapped online always covers the pool),
 * holding blocks of `block_bytes` per region. `info` may be NULL. */
int valve_client_kv_space(valve_client *c, uint32_t regions, uint64_t capacity_bytes_per_region,
                          uint64_t block_bytes, valve_kv_space_info *info);

/* valve_client_kv_space, plus `tail_bytes` of the process's own zeroed memory (rounded up to
 * whole pages) right after each region's region_bytes, never reclaimed: a framework's padding
 * blocks go there. One private block backs every region's tail. */
int valve_client_kv_space_tail(valve_client *c, uint32_t regions,
                               uint64_t capacity_bytes_per_region, uint64_t block_bytes,
                               uint64_t tail_bytes, valve_kv_space_info *info);

/* Asks for `count` more handles; writes the slots they back to slots_out (cap >= count) and
 * their number to *n_out, which can be less than count (online: the pool was short; offline: a
 * reclaim took lent handles before they were mapped). Premapped online: slot = handle id. */
int valve_client_grow(valve_client *c, uint32_t count, uint32_t *slots_out, size_t cap,
                      size_t *n_out);

/* Gives slots back (offline and serial online: unmapped; premapped online: kept mapped). */
int valve_client_shrink(valve_client *c, const uint32_t *slots, size_t n);

/* Online: reports KV bytes in use; *target_handles (may be NULL) is what the daemon's
 * reservation wants this client to hold. */
int valve_client_usage(valve_client *c, uint64_t used_bytes, uint64_t *target_handles);

/* The first device address of a region; 0 on error (see valve_client_last_error). */
uint64_t valve_client_region_ptr(valve_client *c, uint32_t region);

/* Offline, once after each step: writes up to `cap` invalidated block ids to buf and returns
 * how many (call again while it returns cap); a negative value is -status. */
int64_t valve_client_take_invalidated(valve_client *c, uint32_t *buf, size_t cap);

/* Offline with VALVE_CLIENT_EXPLICIT_RELEASE: slots whose invalidated blocks were collected may
 * be refilled now (no kernel of the framework can touch them any more). Returns how many; a
 * negative value is -status. Without the flag, collected slots are refillable at once. */
int64_t valve_client_release_quarantined(valve_client *c);

/* Offline: `request` owns `block` and costs `tokens` to recompute (the latest call for a
 * request sets its cost). */
int valve_client_set_block_owner(valve_client *c, uint32_t block, uint64_t request,
                                 uint64_t tokens);

/* Offline: nobody owns `block` now. */
int valve_client_clear_block(valve_client *c, uint32_t block);

/* Reads the client's numbers. */
int valve_client_stats(valve_client *c, valve_stats *out);

/* The calling thread's last error message ("" after a success); valid until the thread's next
 * valve_client_* call. */
const char *valve_client_last_error(void);

/* Unmaps everything, closes the connections (the daemon takes the handles back) and frees the
 * client. NULL is ignored. */
void valve_client_close(valve_client *c);

#ifdef __cplusplus
}
#endif

#endif /* VALVE_CLIENT_H */
