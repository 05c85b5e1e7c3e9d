/* The RM ioctl argument structs the ioctl logger (LD_PRELOAD) reads: the layouts ioctl-bindings
 * tests for Rust, written again for C with size checks. */
#ifndef VALVE_RM_ABI_H
#define VALVE_RM_ABI_H
#include <stddef.h>
#include <stdint.h>

#define VALVE_ESC_RM_FREE 0x29
#define VALVE_ESC_RM_CONTROL 0x2A
#define VALVE_ESC_RM_ALLOC 0x2B
#define VALVE_ESC_RM_DUP_OBJECT 0x34

struct nvos00 { uint32_t h_root, h_parent, h_object, status; };                       /* RM_FREE */
struct nvos21 { uint32_t h_root, h_parent, h_new, h_class; uint64_t p_params; uint32_t params_size, status; };
struct nvos64 {                                                                        /* RM_ALLOC with rights */
  uint32_t h_root, h_parent, h_new, h_class;
  uint64_t p_params, p_rights;
  uint32_t params_size, flags, status, pad;
};
struct nvos54 {                                                                        /* RM_CONTROL */
  uint32_t h_client, h_object, cmd, flags;
  uint64_t p_params;
  uint32_t params_size, status;
};
struct nvos55 { uint32_t h_client, h_parent, h_object, h_client_src, h_object_src, flags, status; }; /* DUP_OBJECT */
_Static_assert(sizeof(struct nvos00) == 16, "NVOS00");
_Static_assert(sizeof(struct nvos55) == 28, "NVOS55");
_Static_assert(sizeof(struct nvos21) == 32, "NVOS21");
_Static_assert(sizeof(struct nvos64) == 48, "NVOS64");
_Static_assert(sizeof(struct nvos54) == 32 && offsetof(struct nvos54, p_params) == 16, "NVOS54");
#endif
