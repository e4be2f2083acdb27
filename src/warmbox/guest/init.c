/* wb-init: a command in its own PID namespace, where the agent has no cgroup of its own to
 * give it (gVisor; see Scopes in scopes.py). Built static by the image builder.
 *
 *   wb-init CTLFD REPORTFD KEEPFD CWD EXE ARGV0 [ARG...]
 *
 * Unshares a user namespace (the uid and gid map to themselves: `id` and file owners stay the
 * same for the sandbox user) and a PID namespace, forks the namespace's init, writes the init's
 * pid (a 4-byte int, as the agent sees it; -errno when any of that failed) to CTLFD and exits:
 * the init is re-parented to the agent. The init runs the command as PID 2, writes its wait
 * status (a 4-byte int) to REPORTFD when it ends, and reaps until the namespace is empty. When
 * the init dies the kernel kills every process in the namespace, and no process inside can
 * signal it (SIGINT from the agent goes on to the command); what the command leaves behind
 * when it exits normally lives on under it. KEEPFD (or -1) stays open for the command; CWD ""
 * means no chdir. When the exec fails, "ARGV0: reason" goes to stderr and the status is 127
 * (not found) or 126, as a shell does. Exec'd afresh, it holds nothing of the agent's memory,
 * so it may be dumpable (it has to be, to write its own uid map). No allocation.
 *
 *   wb-init --serve SOCKFD
 *
 * The same, without an exec per command (each costs as much as the command's own under gVisor):
 * requests arrive on a SOCK_SEQPACKET socket, one message each ("KEEPFD\0CWD\0EXE\0ARGC\0"
 * then ARGC arguments and the environment, NUL-terminated) with stdin, stdout, stderr, REPORTFD
 * and KEEPFD's file (when not -1) as SCM_RIGHTS; each gets a 4-byte answer: the init's pid or
 * -errno. The inits are clones of this process, reaped by the kernel (SA_NOCLDWAIT).
 * Processes of the commands live in other user namespaces and cannot trace or read this one.
 *
 *   wb-init --confine PIDS UID GID EXE ARG...
 *
 * gVisor's first process, started as root of the sandbox's kernel (CAP_SYS_ADMIN, CAP_DAC_OVERRIDE,
 * CAP_SETUID, CAP_SETGID and CAP_SETPCAP there; nothing on the host): mounts the sandbox kernel's pids
 * controller at /sys/fs/cgroup, makes the cgroup "sandbox" there with pids.max = PIDS and moves
 * itself into it, empties its capability bounding set, becomes UID:GID with no supplementary
 * group and no capability, and execs EXE (the agent, which keeps PID 1). Everything started in
 * the sandbox is then counted against PIDS by the Sentry, and a fork or clone past it gets EAGAIN,
 * as in a container's pids cgroup, while the host's pids cgroup holds the Sentry and its host
 * threads with room to spare (a host thread the Sentry cannot make ends the whole sandbox). The
 * cgroup's files stay root's: the sandbox user can read them, not raise the limit or leave.
 * Any failure: the reason on stderr and exit 125, so the sandbox does not start unconfined.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <grp.h>
#include <linux/capability.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

static void put(int fd, const char *s) {
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(fd, s, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return;
        s += w;
        n -= (size_t)w;
    }
}

static int full_write(int fd, const void *buf, size_t n) {
    const char *p = buf;
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) return -1;
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

static int write_file(const char *path, const char *text) {
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int r = full_write(fd, text, strlen(text));
    close(fd);
    return r;
}

static char *fmt_uint(char *out, unsigned id) { /* decimal, not terminated: returns its end */
    char digits[16];
    int n = 0;
    do { digits[n++] = (char)('0' + id % 10); id /= 10; } while (id);
    for (int i = n - 1; i >= 0; i--) *out++ = digits[i];
    return out;
}

static void fmt_map(char *out, unsigned id) { /* "ID ID 1" */
    for (int pass = 0; pass < 2; pass++) {
        out = fmt_uint(out, id);
        *out++ = ' ';
    }
    *out++ = '1';
    *out = 0;
}

static void actions(void (*handler)(int)) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    for (int s = 1; s < NSIG; s++)
        if (s != SIGCHLD || handler == SIG_DFL) sigaction(s, &sa, 0); /* KILL, STOP: refused */
}

static void retitle(int argc, char **argv, const char *title) {
    /* what ps and pgrep -f show for these processes: never the command's words */
    char *start = argv[0], *end = argv[argc - 1] + strlen(argv[argc - 1]);
    size_t n = strlen(title);
    if ((size_t)(end - start) < n) return;
    memset(start, 0, (size_t)(end - start));
    memcpy(start, title, n);
    prctl(PR_SET_NAME, title);
}

static void run(const char *cwd, const char *exe, char **argv) { /* never returns */
    actions(SIG_DFL);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, 0);
    if (cwd[0] && chdir(cwd) != 0) {
        put(2, "cannot change directory to ");
        put(2, cwd);
        put(2, "\n");
        _exit(126);
    }
    execv(exe, argv);
    int e = errno;
    const char *why = strerrordesc_np(e);
    put(2, argv[0]);
    put(2, ": ");
    put(2, why ? why : "cannot execute");
    put(2, "\n");
    _exit(e == ENOENT ? 127 : 126);
}

static int kept(int fd, const int *keep, int n) {
    for (int i = 0; i < n; i++)
        if (keep[i] == fd) return 1;
    return 0;
}

static int close_others(const int *keep, int n) {
    /* close every fd but keep[0..n) (sorted, distinct): close_range, or where there is none
     * (gVisor) the entries of /proc/self/fd (a loop to RLIMIT_NOFILE costs seconds there) */
    unsigned lo = 0;
    int ok = 1;
    for (int i = 0; i <= n && ok; i++) {
        unsigned hi = i < n ? (unsigned)keep[i] : ~0U;
        if (hi > lo && syscall(SYS_close_range, lo, hi - 1, 0) != 0) ok = 0;
        lo = hi + 1;
    }
    if (ok) return 0;
    int dir = open("/proc/self/fd", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir < 0) return -1;
    char buf[4096];
    for (;;) {
        long got = syscall(SYS_getdents64, dir, buf, sizeof buf);
        if (got < 0) { close(dir); return -1; }
        if (got == 0) break;
        for (long off = 0; off < got;) {
            unsigned short reclen;
            memcpy(&reclen, buf + off + 16, sizeof reclen); /* struct linux_dirent64: d_reclen */
            const char *name = buf + off + 19;
            off += reclen;
            if (name[0] < '0' || name[0] > '9') continue;
            int fd = atoi(name);
            if (fd != dir && !kept(fd, keep, n)) close(fd);
        }
    }
    close(dir);
    return 0;
}

static void drop_bounding_set(void) {
    /* a new user namespace starts with every capability in its bounding set: empty it, as
     * outside, so that nothing the command execs can gain one there (the init keeps its own,
     * which also keeps the command's processes from tracing it) */
    for (int cap = 0; cap < 64; cap++)
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno == EINVAL) break;
}

static volatile pid_t command = 0;
#define STARTED 0x7ffffffe     /* first word on the report pipe: the command runs (scopes.py _STARTED) */
#define NOT_STARTED 0x7ffffffd /* ... or no process was left for it (scopes.py _NOT_STARTED) */

static void forward(int sig) {
    if (command > 0) kill(command, sig);
}

static void init(int report, const char *cwd, const char *exe, char **cmd_argv, int argc, char **argv,
                 int keep) {
    /* PID 1 of the command's namespace */
    signal(SIGCHLD, SIG_DFL); /* the server's children are reaped by the kernel, this one's not */
    pid_t pid = vfork();
    if (pid == 0) run(cwd, exe, cmd_argv);
    /* the first word on the report pipe says whether the command runs: at the pids limit this
     * vfork is what fails (this init took the last pid), and the agent's start must fail then,
     * as it does when the init itself cannot be made; the command's wait status comes after */
    int started = pid < 0 ? NOT_STARTED : STARTED;
    if (report >= 0 && full_write(report, &started, sizeof started) != 0) _exit(0);
    if (pid < 0) _exit(0);
    command = pid;
    actions(SIG_IGN);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = forward;
    sigaction(SIGINT, &sa, 0);
    retitle(argc, argv, "wb-init");
    close(0); /* the command's pipes are its own */
    close(1);
    close(2);
    if (keep >= 0) close(keep);
    for (;;) {
        int status;
        pid_t w = waitpid(-1, &status, 0);
        if (w < 0) {
            if (errno == EINTR) continue;
            _exit(0); /* ECHILD: the namespace is empty */
        }
        if (w == pid && report >= 0) {
            command = 0;
            if (full_write(report, &status, sizeof status) != 0) _exit(0); /* the agent is gone: end all */
            close(report);
            report = -1;
        }
    }
}

#define MAX_MSG (128 << 10)
#define MAX_STRINGS 8192
static char msg[MAX_MSG + 1];
static char *strs[MAX_STRINGS + 2];

static int map_child(pid_t pid, unsigned uid, unsigned gid) {
    char path[64], map[48], num[16];
    int n = 0;
    unsigned v = (unsigned)pid;
    do { num[n++] = (char)('0' + v % 10); v /= 10; } while (v);
    const char *names[3] = {"uid_map", "setgroups", "gid_map"};
    for (int i = 0; i < 3; i++) {
        char *o = path;
        for (const char *c = "/proc/"; *c; c++) *o++ = *c;
        for (int j = n - 1; j >= 0; j--) *o++ = num[j];
        *o++ = '/';
        for (const char *c = names[i]; *c; c++) *o++ = *c;
        *o = 0;
        if (i == 1) {
            if (write_file(path, "deny") != 0 && errno != ENOENT) return -1; /* gVisor: none */
            continue;
        }
        fmt_map(map, i == 0 ? uid : gid);
        if (write_file(path, map) != 0) return -1;
    }
    return 0;
}

static int spawn_one(ssize_t len, const int *fds, int nfd, int argc, char **argv) {
    /* one request: the init's pid, or -errno */
    msg[len] = 0;
    int n = 0;
    for (char *p = msg; p < msg + len && n < MAX_STRINGS; p += strlen(p) + 1) strs[n++] = p;
    if (n < 5 || n >= MAX_STRINGS) return -E2BIG;
    int keep = atoi(strs[0]), nargs = atoi(strs[3]);
    if (nargs < 1 || 4 + nargs > n || nfd != (keep >= 0 ? 5 : 4)) return -EINVAL;
    const char *cwd = strs[1], *exe = strs[2];
    char **cmd_argv = strs + 4, **envp = strs + 4 + nargs + 1;
    /* the environment moves up one slot so that argv gets its NULL */
    for (int i = n; i > 4 + nargs; i--) strs[i] = strs[i - 1];
    strs[4 + nargs] = 0;
    strs[n + 1] = 0;
    int sync[2];
    if (pipe2(sync, O_CLOEXEC) != 0) return -errno;
    pid_t pid = (pid_t)syscall(SYS_clone, CLONE_NEWUSER | CLONE_NEWPID | SIGCHLD, 0, 0, 0, 0);
    if (pid < 0) {
        int e = errno;
        close(sync[0]);
        close(sync[1]);
        return -e;
    }
    if (pid == 0) {
        environ = envp;
        close(sync[1]);
        /* to fds above all targets first, so that placing one never overwrites another */
        int floor = (keep > 8 ? keep : 8) + 1, hi[5], R = 3 == keep ? 4 : 3;
        for (int i = 0; i < nfd; i++)
            if ((hi[i] = fcntl(fds[i], F_DUPFD, floor)) < 0) _exit(126);
        int s = fcntl(sync[0], F_DUPFD, floor);
        for (int i = 0; i < 3; i++)
            if (dup2(hi[i], i) < 0) _exit(126);
        if (dup2(hi[3], R) < 0 || (keep >= 0 && dup2(hi[4], keep) < 0)) _exit(126);
        int k[6] = {0, 1, 2, R, keep, s}, m = 0, sorted[6];
        for (int i = 0; i < 6; i++) {
            if (k[i] < 0) continue;
            int j = m++;
            while (j > 0 && sorted[j - 1] > k[i]) { sorted[j] = sorted[j - 1]; j--; }
            sorted[j] = k[i];
        }
        if (close_others(sorted, m) != 0) _exit(126);
        fcntl(R, F_SETFD, FD_CLOEXEC);
        drop_bounding_set();
        char go = 0;
        ssize_t got;
        do got = read(s, &go, 1); while (got < 0 && errno == EINTR);
        close(s);
        if (got != 1 || go != 'g') _exit(126);
        init(R, cwd, exe, cmd_argv, argc, argv, keep);
    }
    close(sync[0]);
    int e = map_child(pid, getuid(), getgid()) == 0 ? 0 : errno;
    if (e == 0 && full_write(sync[1], "g", 1) != 0) e = errno;
    close(sync[1]);
    if (e) {
        kill(pid, SIGKILL);
        return -e;
    }
    return pid;
}

static void serve(int sock, int argc, char **argv) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_IGN;
    sa.sa_flags = SA_NOCLDWAIT;
    sigaction(SIGCHLD, &sa, 0);
    for (;;) {
        struct iovec iov = {msg, MAX_MSG};
        union { char buf[CMSG_SPACE(sizeof(int) * 8)]; struct cmsghdr align; } c;
        struct msghdr mh;
        memset(&mh, 0, sizeof mh);
        mh.msg_iov = &iov;
        mh.msg_iovlen = 1;
        mh.msg_control = c.buf;
        mh.msg_controllen = sizeof c.buf;
        ssize_t n = recvmsg(sock, &mh, MSG_CMSG_CLOEXEC);
        if (n < 0 && errno == EINTR) continue;
        if (n <= 0) _exit(0); /* the agent is gone */
        int fds[8], nfd = 0;
        for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm)) {
            if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
            int count = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < count && nfd < 8; i++) memcpy(&fds[nfd++], CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
        }
        int reply = (mh.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) ? -E2BIG : spawn_one(n, fds, nfd, argc, argv);
        for (int i = 0; i < nfd; i++) close(fds[i]);
        memset(msg, 0, (size_t)n); /* the next init's copy of this memory holds its own request only */
        if (send(sock, &reply, sizeof reply, MSG_NOSIGNAL) != (ssize_t)sizeof reply) _exit(0);
    }
}

static void refuse(const char *what) { /* never returns */
    const char *why = strerrordesc_np(errno);
    put(2, "wb-init --confine: ");
    put(2, what);
    put(2, ": ");
    put(2, why ? why : "failed");
    put(2, "\n");
    _exit(125);
}

static void confine(char **argv) { /* PIDS UID GID EXE ARG...; never returns */
    const char *pids = argv[0];
    unsigned uid = (unsigned)atoi(argv[1]), gid = (unsigned)atoi(argv[2]);
    char self[16];
    if (atoi(pids) < 1) {
        errno = EINVAL;
        refuse("PIDS");
    }
    if (mount("pids", "/sys/fs/cgroup", "cgroup", MS_NOSUID | MS_NODEV | MS_NOEXEC, "pids") != 0)
        refuse("mount the pids controller at /sys/fs/cgroup");
    if (mkdir("/sys/fs/cgroup/sandbox", 0755) != 0 && errno != EEXIST) refuse("mkdir /sys/fs/cgroup/sandbox");
    if (write_file("/sys/fs/cgroup/sandbox/pids.max", pids) != 0) refuse("write pids.max");
    *fmt_uint(self, (unsigned)getpid()) = 0;
    if (write_file("/sys/fs/cgroup/sandbox/cgroup.procs", self) != 0) refuse("join the cgroup");
    drop_bounding_set();
    if (prctl(PR_CAPBSET_READ, CAP_SYS_ADMIN, 0, 0, 0) != 0) refuse("empty the capability bounding set");
    if (setgroups(0, 0) != 0) refuse("setgroups");
    if (setresgid(gid, gid, gid) != 0) refuse("setresgid");
    if (setresuid(uid, uid, uid) != 0) refuse("setresuid"); /* from root to another uid: no capability left */
    if (getuid() != uid || geteuid() != uid || getgid() != gid || getegid() != gid) {
        errno = EPERM;
        refuse("become the sandbox user");
    }
    execv(argv[3], argv + 3);
    refuse(argv[3]);
}

int main(int argc, char **argv) {
    if (argc >= 6 && strcmp(argv[1], "--confine") == 0) confine(argv + 2);
    if (argc == 3 && strcmp(argv[1], "--serve") == 0) {
        actions(SIG_IGN);
        serve(atoi(argv[2]), argc, argv);
    }
    if (argc < 7) {
        put(2, "usage: wb-init CTLFD REPORTFD KEEPFD CWD EXE ARGV0 [ARG...]\n");
        return 2;
    }
    int ctl = atoi(argv[1]), report = atoi(argv[2]), keep = atoi(argv[3]);
    const char *cwd = argv[4], *exe = argv[5];
    char **cmd_argv = argv + 6;
    actions(SIG_IGN); /* the agent signals the command's processes, never the init */
    fcntl(ctl, F_SETFD, FD_CLOEXEC);
    fcntl(report, F_SETFD, FD_CLOEXEC); /* the command must not hold them */
    char map[48];
    unsigned uid = getuid(), gid = getgid();
    pid_t pid = -1;
    if (unshare(CLONE_NEWUSER | CLONE_NEWPID) == 0) {
        fmt_map(map, uid);
        int ok = write_file("/proc/self/uid_map", map) == 0;
        ok = ok && (write_file("/proc/self/setgroups", "deny") == 0 || errno == ENOENT); /* gVisor: none */
        fmt_map(map, gid);
        if (ok && write_file("/proc/self/gid_map", map) == 0) {
            drop_bounding_set();
            pid = fork();
        }
    }
    if (pid < 0) { /* the agent says why (or starts the command another way) */
        int err = -(errno ? errno : EIO);
        full_write(ctl, &err, sizeof err);
        _exit(126);
    }
    if (pid == 0) {
        close(ctl);
        init(report, cwd, exe, cmd_argv, argc, argv, keep);
    }
    _exit(full_write(ctl, &pid, sizeof pid) == 0 ? 0 : 126);
}
