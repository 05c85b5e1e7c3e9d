/* Run under LD_PRELOAD=libvalve_ioctl_log.so: the interposer must pass results and errno through
 * unchanged and log nothing for ioctls that fail (here an RM alloc on /dev/null: ENOTTY). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/ioctl.h>
#include <unistd.h>

int main(void) {
  int p[2], avail = -1, bad = 0;
  if (pipe(p) != 0) return 2;
  if (write(p[1], "abc", 3) != 3) return 2;
  if (ioctl(p[0], FIONREAD, &avail) != 0 || avail != 3) { printf("FAIL FIONREAD passthrough\n"); bad++; }
  unsigned nvos64[12] = {0, 0, 0x1, 0x41};
  int fd = open("/dev/null", O_RDWR);
  errno = 0;
  int r = ioctl(fd, _IOWR('F', 0x2B, unsigned[12]), nvos64);
  if (r != -1 || errno != ENOTTY) { printf("FAIL errno passthrough (r=%d errno=%d)\n", r, errno); bad++; }
  printf("%d passed, %d failed\n", 2 - bad, bad);
  return bad != 0;
}
