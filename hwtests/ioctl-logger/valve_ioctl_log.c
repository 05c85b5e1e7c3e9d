/* LD_PRELOAD logger of NVIDIA RM object creation: interposes ioctl(2) and appends one line per
 * successful RM_ALLOC / RM_FREE / RM_DUP_OBJECT (and channel controls) to $VALVE_IOCTL_LOG. A stand-in for eBPF
 * discovery in hwtests, and the way to see objects a process duplicates from another client. */
#define _GNU_SOURCE
#include "valve_ioctl_log.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

#include "rm_abi.h"

#define ESC_RM_FREE VALVE_ESC_RM_FREE
#define ESC_RM_ALLOC VALVE_ESC_RM_ALLOC
#define ESC_RM_DUP VALVE_ESC_RM_DUP_OBJECT
#define ESC_RM_CONTROL VALVE_ESC_RM_CONTROL
#define CLASS_DEVICE 0x80u
#define CLASS_SUBDEVICE 0x2080u

static size_t alloc_line(char *buf, size_t cap, int pid, uint32_t root, uint32_t parent,
                         uint32_t obj, uint32_t cls, uint64_t p_params, uint32_t params_size) {
  char extra[16] = "-";
  /* CUDA 13 passes the params pointer with paramsSize 0 (RM knows each class's size), so only
   * the pointer decides; a nonzero size smaller than a u32 is malformed. */
  if ((cls == CLASS_DEVICE || cls == CLASS_SUBDEVICE) && p_params && (params_size == 0 || params_size >= 4)) {
    uint32_t v;
    memcpy(&v, (const void *)(uintptr_t)p_params, sizeof v);
    snprintf(extra, sizeof extra, "%x", v);
  }
  int n = snprintf(buf, cap, "alloc %x %x %x %x %x %s\n", (unsigned)pid, root, parent, obj, cls, extra);
  return n > 0 && (size_t)n < cap ? (size_t)n : 0;
}

int valve_logged_control(uint32_t cmd) {
  /* The channel classes' controls (GPFIFO_SCHEDULE, GET_WORK_SUBMIT_TOKEN, ...): 0x906f, 0xa06f,
   * 0xc36f and the channel group's 0xa06c. */
  uint32_t cls = cmd >> 16;
  return cls == 0x906f || cls == 0xa06f || cls == 0xc36f || cls == 0xa06c;
}

size_t valve_format_rm_call(char *buf, size_t cap, int pid, unsigned long request, const void *before,
                            const void *arg) {
  if (arg == NULL || before == NULL || _IOC_TYPE(request) != 'F') return 0;
  unsigned nr = _IOC_NR(request), size = _IOC_SIZE(request);
  if (nr == ESC_RM_ALLOC && size == sizeof(struct nvos64)) {
    const struct nvos64 *a = arg, *b = before;
    if (a->status != 0) return 0;
    return alloc_line(buf, cap, pid, a->h_root, a->h_parent, a->h_new, a->h_class, b->p_params, b->params_size);
  }
  if (nr == ESC_RM_ALLOC && size == sizeof(struct nvos21)) {
    const struct nvos21 *a = arg, *b = before;
    if (a->status != 0) return 0;
    return alloc_line(buf, cap, pid, a->h_root, a->h_parent, a->h_new, a->h_class, b->p_params, b->params_size);
  }
  if (nr == ESC_RM_FREE && size == sizeof(struct nvos00)) {
    const struct nvos00 *f = arg;
    if (f->status != 0) return 0;
    int n = snprintf(buf, cap, "free %x %x %x %x\n", (unsigned)pid, f->h_root, f->h_parent, f->h_object);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
  }
  if (nr == ESC_RM_CONTROL && size == sizeof(struct nvos54)) {
    const struct nvos54 *c = arg;
    if (c->status != 0 || !valve_logged_control(c->cmd) || !c->p_params || c->params_size < 4) return 0;
    uint32_t v;
    memcpy(&v, (const void *)(uintptr_t)c->p_params, sizeof v);
    int n = snprintf(buf, cap, "ctrl %x %x %x %x %x\n", (unsigned)pid, c->h_client, c->h_object, c->cmd, v);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
  }
  if (nr == ESC_RM_DUP && size == sizeof(struct nvos55)) {
    const struct nvos55 *d = arg;
    if (d->status != 0) return 0;
    int n = snprintf(buf, cap, "dup %x %x %x %x %x %x\n", (unsigned)pid, d->h_client, d->h_parent,
                     d->h_object, d->h_client_src, d->h_object_src);
    return n > 0 && (size_t)n < cap ? (size_t)n : 0;
  }
  return 0;
}

#ifndef VALVE_IOCTL_LOG_NO_INTERPOSE
typedef int (*ioctl_fn)(int, unsigned long, ...);
static ioctl_fn real_ioctl;
static int log_fd = -1;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void init(void) {
  real_ioctl = (ioctl_fn)dlsym(RTLD_NEXT, "ioctl");
  const char *path = getenv("VALVE_IOCTL_LOG");
  if (path && *path) log_fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
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
  /* Snapshot RM alloc/free arguments before the call: the params pointer does not come back. */
  unsigned char before[VALVE_RM_ARG_MAX];
  int watched = log_fd >= 0 && arg != NULL && _IOC_TYPE(request) == 'F' &&
                (_IOC_NR(request) == ESC_RM_ALLOC || _IOC_NR(request) == ESC_RM_FREE ||
                 _IOC_NR(request) == ESC_RM_DUP || _IOC_NR(request) == ESC_RM_CONTROL) &&
                _IOC_SIZE(request) <= sizeof before;
  if (watched) memcpy(before, arg, _IOC_SIZE(request));
  int ret = real_ioctl(fd, request, arg);
  if (ret == 0 && watched) {
    int saved = errno;
    char line[128];
    size_t n = valve_format_rm_call(line, sizeof line, getpid(), request, before, arg);
    if (n) {
      ssize_t w = write(log_fd, line, n); /* one write per line: O_APPEND keeps lines whole */
      (void)w;
    }
    errno = saved;
  }
  return ret;
}
#endif
