/* Decision and formatting of the ioctl logger, separate from the interposer so a test can call it
 * with synthetic RM argument structs. */
#ifndef VALVE_IOCTL_LOG_H
#define VALVE_IOCTL_LOG_H
#include <stddef.h>
#include <stdint.h>

/* Formats the log line for a successful ioctl (the call returned 0) into buf, or returns 0 when
 * the call is not an RM alloc/free/dup or RM reported a failure in the struct's status field.
 * `before` is a copy of the argument struct taken before the call (the driver does not hand the
 * params pointer back), `after` the struct as the driver left it (status, kernel-chosen handles).
 * Lines: "alloc <pid> <hRoot> <hParent> <hNew> <hClass> <extra|->\n" and
 *        "free <pid> <hRoot> <hParent> <hObject>\n",
 *        "dup <pid> <hClient> <hParent> <hObject> <hClientSrc> <hObjectSrc>\n" (RM_DUP_OBJECT),
 *        "ctrl <pid> <hClient> <hObject> <cmd> <first u32 of params after the call>\n" (RM_CONTROL
 *        of a channel or channel-group class, e.g. the work submit token, 0xc36f0108),
 * all numbers lowercase hex without 0x. */
size_t valve_format_rm_call(char *buf, size_t cap, int pid, unsigned long request, const void *before,
                            const void *after);

/* Whether an RM_CONTROL command is logged: the channel and channel-group classes' controls. */
int valve_logged_control(uint32_t cmd);

/* Largest argument struct the logger snapshots. */
#define VALVE_RM_ARG_MAX 48

#endif
