/* spawn.so: how the guest agent starts a command in the command's own cgroup, with no process
 * in between (Scopes in scopes.py; loaded with ctypes, built by the image builder).
 *
 * wb_spawn_cgroup: vfork; the child moves itself into the command's cgroup (a write of "0" to
 * procs_fd, that cgroup's cgroup.procs) before it execs, so the command and all it ever starts
 * are in it; the agent ends them with cgroup.kill. The cgroup is reachable only through the
 * agent's fd, never by a path inside the sandbox, so no process of the command can move itself
 * out. The command runs in a new session with default signal actions, stdio from fd0..fd2,
 * keep_fd (or -1) left open at its number, in cwd (or NULL). When exec fails the child writes
 * "ARGV0: reason" to its stderr and exits 127 (not found) or 126, as a shell does.
 * Returns the command's pid or -errno.
 *
 * The child runs in the memory of a multithreaded Python process (vfork): it makes system calls
 * only, no allocation, no stdio, no locks. (An extra exec here would cost as much as the
 * command's own; the PID-namespace mode for tiers without a host cgroup is wb-init, init.c.)
 *
 * Built with the host's gcc, loaded by a template image's glibc: it asks for nothing newer than
 * glibc 2.2.5 (sigprocmask, not pthread_sigmask@2.32; its own reasons, not strerrordesc_np@2.32),
 * so images with an older glibc than the host's load it too.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <string.h>
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

static void default_actions(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = SIG_DFL;
    for (int s = 1; s < NSIG; s++) sigaction(s, &sa, 0);  /* KILL, STOP: refused, harmless */
}

static void unblock_all(void) {
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, 0);
}

/* why an exec failed, in glibc's words for the reasons an exec has */
static const char *reason(int e) {
    switch (e) {
        case ENOENT: return "No such file or directory";
        case EACCES: return "Permission denied";
        case EPERM: return "Operation not permitted";
        case ENOEXEC: return "Exec format error";
        case E2BIG: return "Argument list too long";
        case ENOMEM: return "Cannot allocate memory";
        case ETXTBSY: return "Text file busy";
        case ENOTDIR: return "Not a directory";
        case EISDIR: return "Is a directory";
        case ELOOP: return "Too many levels of symbolic links";
        case ENAMETOOLONG: return "File name too long";
        case EAGAIN: return "Resource temporarily unavailable";
        case EIO: return "Input/output error";
        case ELIBBAD: return "Accessing a corrupted shared library";
        default: return 0;
    }
}

static int place(int from, int to) {  /* dup2 that also clears CLOEXEC when from == to */
    if (from == to) return fcntl(to, F_SETFD, 0);
    return dup2(from, to) < 0 ? -1 : 0;
}

/* The command's side: never returns. */
static void run(const char *exe, char *const argv[], char *const envp[], const char *cwd,
                const int stdio[3], int keep_fd) {
    default_actions();
    unblock_all();
    /* stdio first to fds above 2, so that placing one never overwrites another */
    int tmp[3];
    for (int i = 0; i < 3; i++) {
        tmp[i] = fcntl(stdio[i], F_DUPFD_CLOEXEC, 3);
        if (tmp[i] < 0) _exit(126);
    }
    for (int i = 0; i < 3; i++)
        if (place(tmp[i], i) != 0) _exit(126);
    if (keep_fd >= 0 && place(keep_fd, keep_fd) != 0) _exit(126);
    if (cwd && chdir(cwd) != 0) {
        put(2, "cannot change directory to ");
        put(2, cwd);
        put(2, "\n");
        _exit(126);
    }
    execve(exe, argv, envp);
    int e = errno;
    const char *why = reason(e);
    put(2, argv[0]);
    put(2, ": ");
    put(2, why ? why : "cannot execute");
    put(2, "\n");
    _exit(e == ENOENT ? 127 : 126);
}

static void block_all(sigset_t *old) {
    sigset_t all;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, old);  /* the calling thread's mask, as pthread_sigmask */
}

int wb_spawn_cgroup(const char *exe, char *const argv[], char *const envp[], const char *cwd,
                    int fd0, int fd1, int fd2, int keep_fd, int procs_fd) {
    int stdio[3] = {fd0, fd1, fd2};
    volatile int err = 0;  /* shared with the vfork child */
    sigset_t old;
    block_all(&old);  /* no handler of the agent may run in the child, which shares its memory */
    pid_t pid = vfork();
    if (pid == 0) {
        if (setsid() < 0 || write(procs_fd, "0", 1) != 1) {
            err = errno ? errno : EIO;
            _exit(126);
        }
        run(exe, argv, envp, cwd, stdio, keep_fd);
    }
    int e = errno;
    sigprocmask(SIG_SETMASK, &old, 0);
    if (pid < 0) return -e;
    if (err) return -err;  /* the child exited (126); the agent's reaper collects it */
    return pid;
}
