/* The C ABI round trip run by src/tests/c_abi.rs against the mock daemon (fake GPU):
 * connect, KV space, grow, block owners, a reclaim the test triggers, invalidated blocks,
 * stats, shrink, a refusal, close. Prints what it saw; exits non-zero on the first surprise. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "valve_client.h"

#define CHECK(call)                                                                      \
    do {                                                                                 \
        int rc_ = (call);                                                                \
        if (rc_ != VALVE_OK) {                                                           \
            fprintf(stderr, "line %d: %s -> %d: %s\n", __LINE__, #call, rc_,              \
                    valve_client_last_error());                                          \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

#define EXPECT(cond)                                                                     \
    do {                                                                                 \
        if (!(cond)) {                                                                   \
            fprintf(stderr, "line %d: expected %s (last error: %s)\n", __LINE__, #cond,   \
                    valve_client_last_error());                                          \
            return 1;                                                                    \
        }                                                                                \
    } while (0)

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SOCKET\n", argv[0]);
        return 2;
    }
    valve_client *c = NULL;
    int rc = valve_client_connect("/nonexistent/valve/pool.sock", VALVE_ROLE_OFFLINE, "0",
                                  VALVE_CLIENT_FAKE_GPU, &c);
    EXPECT(rc == VALVE_E_CONNECT && c == NULL);
    EXPECT(strstr(valve_client_last_error(), "does not exist") != NULL);
    EXPECT(valve_client_connect(argv[1], 7, "0", VALVE_CLIENT_FAKE_GPU, &c) == VALVE_E_INVALID);

    CHECK(valve_client_connect(argv[1], VALVE_ROLE_OFFLINE, "0", VALVE_CLIENT_FAKE_GPU, &c));
    EXPECT(valve_client_grow(c, 1, NULL, 0, NULL) == VALVE_E_INVALID);
    valve_kv_space_info info;
    CHECK(valve_client_kv_space(c, 2, 0, 1u << 20, &info));
    printf("space regions=%u slots=%u blocks_per_slot=%u piece=%" PRIu64 "\n", info.regions,
           info.slots, info.blocks_per_slot, info.piece_bytes);

    uint32_t slots[8];
    size_t n = 0;
    CHECK(valve_client_grow(c, 3, slots, 8, &n));
    printf("grow %zu: %u %u %u\n", n, slots[0], slots[1], slots[2]);
    uint64_t p0 = valve_client_region_ptr(c, 0), p1 = valve_client_region_ptr(c, 1);
    EXPECT(p0 != 0 && p1 - p0 == info.region_bytes);
    EXPECT(valve_client_region_ptr(c, 5) == 0 && valve_client_last_error()[0] != 0);

    CHECK(valve_client_set_block_owner(c, 0, 1, 100)); /* slot 0 */
    CHECK(valve_client_set_block_owner(c, 4, 2, 5));   /* slot 1 */
    CHECK(valve_client_set_block_owner(c, 8, 3, 50));  /* slot 2 ... */
    CHECK(valve_client_clear_block(c, 8));             /* ... freed again */
    EXPECT(valve_client_set_block_owner(c, 999, 1, 1) == VALVE_E_INVALID);
    printf("ready\n");
    fflush(stdout);

    char line[64];
    if (!fgets(line, sizeof line, stdin)) /* the test has the daemon reclaim 2 handles */
        return 1;
    uint32_t blocks[3];
    int64_t k;
    printf("invalidated");
    while ((k = valve_client_take_invalidated(c, blocks, 3)) > 0)
        for (int64_t i = 0; i < k; i++)
            printf(" %u", blocks[i]);
    printf("\n");
    EXPECT(k == 0);

    valve_stats st;
    CHECK(valve_client_stats(c, &st));
    printf("stats held=%u quarantined=%u reclaims=%" PRIu64 " handles=%" PRIu64 "\n",
           st.held_slots, st.quarantined_slots, st.reclaims, st.reclaimed_handles);
    uint32_t back[1] = {0};
    CHECK(valve_client_shrink(c, back, 1));
    printf("usage %d\n", valve_client_usage(c, 1, NULL));
    /* Without VALVE_CLIENT_EXPLICIT_RELEASE, collected slots were refillable already. */
    EXPECT(valve_client_release_quarantined(c) == 0);
    EXPECT(valve_client_release_quarantined(NULL) == -VALVE_E_INVALID);
    EXPECT(valve_client_kv_space_tail(c, 1, 0, 1u << 20, 1u << 20, NULL) == VALVE_E_STATE);
    valve_client_close(c);
    valve_client_close(NULL);
    printf("done\n");
    return 0;
}
