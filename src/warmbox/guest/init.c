/* wb-init: a command in its own PID namespace, where the agent has no cgroup of its own to
 * give it (gVisor; see Scopes in agent.py). Built static by the image builder.
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
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
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

static void fmt_map(char *out, unsigned id) { /* "ID ID 1" */
    char digits[16];
    int n = 0;
    do { digits[n++] = (char)('0' + id % 10); id /= 10; } while (id);
    for (int pass = 0; pass < 2; pass++) {
        for (int i = n - 1; i >= 0; i--) *out++ = digits[i];
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

static volatile pid_t command = 0;

static void forward(int sig) {
    if (command > 0) kill(command, sig);
}

static void init(int report, const char *cwd, const char *exe, char **cmd_argv, int argc, char **argv,
                 int keep) {
    /* PID 1 of the command's namespace */
    pid_t pid = vfork();
    if (pid == 0) run(cwd, exe, cmd_argv);
    if (pid < 0) {
        put(2, "cannot start the command: no process left\n");
        int status = 126 << 8;
        if (full_write(report, &status, sizeof status) != 0) _exit(0);
        _exit(0);
    }
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

int main(int argc, char **argv) {
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
            /* a new user namespace starts with every capability in its bounding set: empty it, as
             * outside, so that nothing the command execs can gain one there (the init keeps its
             * own, which also keeps the command's processes from tracing it) */
            for (int cap = 0; cap < 64; cap++)
                if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 && errno == EINVAL) break;
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
