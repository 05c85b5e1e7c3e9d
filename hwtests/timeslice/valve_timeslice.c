/* LD_PRELOAD library for an offline job: every channel group (TSG) the job's CUDA context creates
 * gets the timeslice VALVE_TSG_TIMESLICE_US, set by the job itself right after RM allocated it
 * (NVA06C_CTRL_CMD_SET_TIMESLICE needs no privilege; docs/gate.md, candidate 6). When online has
 * work, the GPU then leaves the job after at most that slice, before the gate's disable lands.
 * Each TSG gets one line on stderr: its handles, the asked and the resulting timeslice, RM's status. */
#define _GNU_SOURCE
#include "valve_timeslice.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

/* The two RM_ALLOC argument layouts (NVOS21, NVOS64): the handles sit at the same offsets. */
struct nvos21 { uint32_t h_root, h_parent, h_new, h_class; uint64_t p_params; uint32_t params_size, status; };
struct nvos64 {
  uint32_t h_root, h_parent, h_new, h_class;
  uint64_t p_params, p_rights;
  uint32_t params_size, flags, status, pad;
};
_Static_assert(sizeof(struct nvos21) == 32, "NVOS21");
_Static_assert(sizeof(struct nvos64) == 48, "NVOS64");
_Static_assert(sizeof(struct valve_nvos54) == 32, "NVOS54");
_Static_assert(offsetof(struct valve_nvos54, p_params) == 16, "NVOS54 params");

int valve_timeslice_control(unsigned long request, const void *arg, uint32_t cmd, uint64_t *params,
                            struct valve_nvos54 *ctl) {
  if (arg == NULL || _IOC_TYPE(request) != 'F' || _IOC_NR(request) != VALVE_ESC_RM_ALLOC) return 0;
  uint32_t root, obj, cls, status;
  if (_IOC_SIZE(request) == sizeof(struct nvos64)) {
    const struct nvos64 *a = arg;
    root = a->h_root, obj = a->h_new, cls = a->h_class, status = a->status;
  } else if (_IOC_SIZE(request) == sizeof(struct nvos21)) {
    const struct nvos21 *a = arg;
    root = a->h_root, obj = a->h_new, cls = a->h_class, status = a->status;
  } else {
    return 0;
  }
  if (status != 0 || cls != VALVE_CLASS_TSG) return 0;
  memset(ctl, 0, sizeof *ctl);
  ctl->h_client = root;
  ctl->h_object = obj;
  ctl->cmd = cmd;
  ctl->p_params = (uint64_t)(uintptr_t)params;
  ctl->params_size = sizeof *params;
  return 1;
}

uint64_t valve_timeslice_us(const char *text) {
  if (text == NULL || *text < '0' || *text > '9') return 0;
  char *end;
  errno = 0;
  unsigned long long v = strtoull(text, &end, 10);
  if (errno != 0 || *end != '\0' || v < 1 || v > 10000000ull) return 0;
  return v;
}

#ifndef VALVE_TIMESLICE_NO_INTERPOSE
typedef int (*ioctl_fn)(int, unsigned long, ...);
static ioctl_fn real_ioctl;
static uint64_t want_us;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void) {
  real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
  const char *text = getenv("VALVE_TSG_TIMESLICE_US");
  want_us = valve_timeslice_us(text);
  if (text && *text && want_us == 0)
    fprintf(stderr, "valve-timeslice: VALVE_TSG_TIMESLICE_US=%s is not 1-10000000 (us): left alone\n", text);
}

/* Sets, then reads back, the new TSG's timeslice on the fd RM allocated it on. */
static void set_timeslice(int fd, const void *arg, unsigned long request) {
  uint64_t us = want_us, now = 0;
  struct valve_nvos54 set, get;
  if (!valve_timeslice_control(request, arg, VALVE_CMD_SET_TIMESLICE, &us, &set)) return;
  valve_timeslice_control(request, arg, VALVE_CMD_GET_TIMESLICE, &now, &get);
  unsigned long ctl_req = _IOWR('F', VALVE_ESC_RM_CONTROL, struct valve_nvos54);
  int r1 = real_ioctl(fd, ctl_req, &set);
  int r2 = real_ioctl(fd, ctl_req, &get);
  fprintf(stderr, "valve-timeslice: pid %d TSG %x/%x: asked %llu us, status 0x%x (ioctl %d); now %llu us "
          "(status 0x%x)\n", (int)getpid(), set.h_client, set.h_object, (unsigned long long)want_us,
          set.status, r1, (unsigned long long)(r2 == 0 && get.status == 0 ? now : 0), get.status);
}

int ioctl(int fd, unsigned long request, ...) {
  va_list ap;
  va_start(ap, request);
  void *arg = va_arg(ap, void *);
  va_end(ap);
  pthread_once(&init_once, init);
  if (!real_ioctl) {
    errno = ENOSYS;
    return -1;
  }
  int ret = real_ioctl(fd, request, arg);
  if (ret == 0 && want_us != 0) {
    int saved = errno;
    set_timeslice(fd, arg, request);
    errno = saved;
  }
  return ret;
}
#endif
